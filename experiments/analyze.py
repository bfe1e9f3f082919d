"""`launch.py analyze GROUP`: a group's markdown table and plots (experiments/programme.py).

A run is `<root>/<group>/<name>/` (metrics.jsonl, run_manifest.json) or a W&B run of the group;
its name is a variant, or for a Hydra sweep's job the variant + "_<swept values>"
("hidden256_train.seed=1"). Writes `<out>/<group>.md` and one PNG per plot of the group.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from experiments import compose
from experiments.programme import COMMON_METRICS, GROUPS, Group, Plot, natural_key
from runtime.atomic import replacing, write_atomic
from runtime.errors import EXIT_USER_ERROR, UserError

PARAMS = "model/params"
METRICS_FILE = "metrics.jsonl"
MANIFEST_FILE = "run_manifest.json"
FIXED_4 = ("accuracy", "exact_match", "adherence")  # fractions: 4 decimals, aligned in a column
MAX_CHANGES = 80  # characters of the "changes" column before it is cut


# ------------------------------------------------------------------------------------ runs


def _num(value: Any) -> float | int | None:
    """A metric value as a number ("nan"/"inf" strings, the JSONL form, as floats), else None."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, (int, float)):
        return value
    if isinstance(value, str) and value.strip().lower() in ("nan", "inf", "-inf", "+inf", "infinity", "-infinity"):
        return float(value)
    return None


class Reached(NamedTuple):
    """When a metric first reached a target: wall seconds since the run's first row, and the step."""
    seconds: float | None
    step: int


@dataclass
class Run:
    name: str  # run directory / W&B run name: "hidden256" or "hidden256_train.seed=1"
    variant: str | None  # the group's variant it runs (None: not one of the group's variants)
    config: dict[str, Any]  # the resolved config, nested
    rows: list[dict[str, Any]]  # {"step", "time", "<prefix>/<name>": value, ...} in logging order
    status: str | None = None  # the manifest's status (W&B: the run's state)
    source: str = ""  # where it was read from

    @property
    def sweep_suffix(self) -> str:
        """What follows "<variant>_" in the name of a sweep job ("train.seed=1"), else ""."""
        if self.variant and self.name != self.variant and self.name.startswith(self.variant + "_"):
            return self.name[len(self.variant) + 1:]
        return ""

    def values(self, key: str) -> list[tuple[int, float | int]]:
        """[(step, value)] of every row that has `key`, in logging order (NaN kept)."""
        return [(int(row.get("step") or 0), value) for row in self.rows if (value := _num(row.get(key))) is not None]

    def last(self, key: str) -> float | int | None:
        vals = self.values(key)
        return vals[-1][1] if vals else None

    def best(self, key: str) -> float | int | None:
        """The largest finite value logged for `key` (None if none)."""
        return max((v for _, v in self.values(key) if math.isfinite(v)), default=None)

    def curve(self, key: str) -> list[tuple[int, float | int]]:
        """[(step, value)] sorted by step; a step logged twice (a resumed run) keeps the later value."""
        return sorted(dict(self.values(key)).items())

    def config_value(self, key: str, default: Any = None) -> Any:
        """A config value by dotted key ("arch.hidden")."""
        if key in self.config:  # a flat config
            return self.config[key]
        node: Any = self.config
        for part in key.split("."):
            if not isinstance(node, Mapping) or part not in node:
                return default
            node = node[part]
        return node

    def time_to(self, key: str, target: float) -> Reached | None:
        """The first row where `key` >= `target`: (wall seconds since the first row, step), or None."""
        start = next((r.get("time") for r in self.rows if _num(r.get("time")) is not None), None)
        for row in self.rows:
            value = _num(row.get(key))
            if value is not None and value >= target:
                t = _num(row.get("time"))
                seconds = t - start if t is not None and start is not None else None
                return Reached(seconds, int(row.get("step") or 0))
        return None


def match_variant(name: str, known: Iterable[str]) -> str | None:
    """The variant a run name runs: the name itself, or the longest variant v with name = v + "_..."."""
    known = list(known)
    if name in known:
        return name
    return max((v for v in known if name.startswith(v + "_")), key=len, default=None)


def _variants(group: str) -> list[str]:
    return compose.variants(group)


def ordered(group: str, runs: Iterable[Run]) -> list[Run]:
    """Runs in the group's variant order (sweep jobs of a variant by name); other names last."""
    order = {v: i for i, v in enumerate(_variants(group))}
    return sorted(runs, key=lambda r: (order.get(r.variant, len(order)), natural_key(r.name)))


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """metrics.jsonl rows; a line that does not parse (a row cut short by a crash) is skipped."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:  # a blank line does not parse either
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(row, dict):
                rows.append({k: (_num(v) if isinstance(v, str) and _num(v) is not None else v) for k, v in row.items()})
    return rows


def _read_manifest(run_dir: Path) -> dict[str, Any]:
    for path in (run_dir / MANIFEST_FILE, run_dir / "checkpoints" / MANIFEST_FILE):
        try:
            with open(path, encoding="utf-8") as f:
                manifest = json.load(f)
            if isinstance(manifest, dict):
                return manifest
        except (OSError, json.JSONDecodeError):
            continue
    return {}


def collect_local(group: str, root: str | Path = "outputs") -> list[Run]:
    """Every run of `group` under `<root>/<group>/` that has a metrics.jsonl, in variant order."""
    group_dir = Path(root) / group
    if not group_dir.is_dir():
        return []
    known = _variants(group)
    runs = []
    for run_dir in sorted(group_dir.iterdir()):
        metrics = run_dir / METRICS_FILE
        if not metrics.is_file():
            continue
        manifest = _read_manifest(run_dir)
        runs.append(Run(name=run_dir.name, variant=match_variant(run_dir.name, known), config=manifest.get("config") or {},
                        rows=read_metrics(metrics), status=manifest.get("status"), source=str(run_dir)))
    return ordered(group, runs)


def collect_wandb(group: str, project: str, entity: str | None = None, *, api: Any = None) -> list[Run]:
    """Every W&B run of `group` in `[entity/]project`, in variant order (`api`: a `wandb.Api()`)."""
    if api is None:
        import wandb  # optional heavy (over 1 s to import): only W&B reads load it

        api = wandb.Api()
    path = f"{entity}/{project}" if entity else project
    known = _variants(group)
    runs = []
    for wb in api.runs(path, filters={"group": group}):
        rows = [{"step": h.get("_step"), "time": h.get("_timestamp"),
                 **{k: _num(v) for k, v in h.items() if not k.startswith("_") and _num(v) is not None}}
                for h in wb.scan_history()]
        rows.sort(key=lambda r: r["step"] if r["step"] is not None else -1)
        name = wb.name or ""
        runs.append(Run(name=name, variant=match_variant(name, known), config=dict(wb.config or {}), rows=rows,
                        status=getattr(wb, "state", None), source=f"wandb:{path}/{getattr(wb, 'id', name)}"))
    return ordered(group, runs)


# ----------------------------------------------------------------------------------- table


def format_value(key: str, value: float | int | None) -> str:
    """A metric for the table: 5.03M parameters, GiB with 2 decimals, accuracies with 4, else 4 significant digits."""
    if value is None:
        return ""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if key == PARAMS:
        for div, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
            if abs(value) >= div:
                return f"{value / div:.2f}{unit}"
        return f"{value:.0f}"
    if "gib" in key.lower():
        return f"{value:.2f}"
    if key.endswith(FIXED_4) and abs(value) <= 1:
        return f"{value:.4f}"
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    return f"{value:.4g}"


def format_seconds(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


SHORT_SECTIONS = ("arch", "optim", "train", "data")  # "arch.hidden" says no more than "hidden"


def _g(value: Any) -> str:
    return f"{value:.6g}" if isinstance(value, float) else str(value)


def _short_value(value: Any) -> Any:
    if value is None:
        return "null"
    if isinstance(value, Mapping) and "start" in value and "end" in value:  # a curriculum ramp
        return f"{_g(value['start'])}->{_g(value['end'])}"
    if isinstance(value, str) and "/" in value:  # a path: its last part says enough
        return value.rstrip("/").rsplit("/", 1)[-1]
    return value


def _variant_changes(group: str, variant: str) -> dict[str, Any]:
    return compose.changes(group, variant)  # swapped presets as "arch=trm_att", then the keys that differ


def what_changes(group: str, run: Run) -> str:
    """What the run's variant changes vs the baseline (compose.changes), shortened to fit the column:
    SHORT_SECTIONS dropped from unambiguous keys, ramps as start->end, paths as their last part;
    a sweep job's swept values follow in brackets."""
    if run.variant is None:
        return f"(not a variant of {group})"
    try:
        change = _variant_changes(group, run.variant)
    except Exception as e:  # noqa: BLE001 - a variant that does not compose (yet): say so, keep the row
        text = f"(does not compose: {type(e).__name__})"
    else:
        tails = [k.split(".", 1)[1] for k in change if "." in k]
        short: dict[str, Any] = {}
        for key, value in change.items():
            section, _, rest = key.partition(".")
            if section in SHORT_SECTIONS and rest and "." not in rest and tails.count(rest) == 1 and rest not in change:
                key = rest
            short[key] = _short_value(value)
        text = compose.describe(short)  # "the baseline" when nothing changes
        if len(text) > MAX_CHANGES:
            words, kept = text.split(" "), []
            for w in words:
                if kept and len(" ".join(kept + [w])) > MAX_CHANGES - 12:
                    break
                kept.append(w)
            if len(kept) < len(words):
                text = " ".join(kept) + f" … (+{len(words) - len(kept)} more)"
    if run.sweep_suffix:
        text += f" [{run.sweep_suffix}]"
    return text


def metric_columns(spec: Group) -> list[str]:
    """COMMON_METRICS then the group's extra_metrics, each once, the primary metric left out."""
    return list(dict.fromkeys(k for k in (*COMMON_METRICS, *spec.extra_metrics) if k != spec.primary))


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def table(group: str, runs: Iterable[Run]) -> str:
    """Markdown: a header line naming the group, then one row per run in variant order."""
    spec = GROUPS[group]
    runs = ordered(group, runs)
    columns = metric_columns(spec)
    head = ["variant", "changes", f"final {spec.primary}", f"best {spec.primary}",
            *("params" if k == PARAMS else k for k in columns), "status", f"steps to {spec.target:g}"]
    lines = [f"## {group}: {spec.title}", "",
             f"Varies {spec.varies}. Primary metric `{spec.primary}`; target {spec.target:g}"
             + (f"; * marks the baseline ({spec.baseline_variant})." if spec.baseline_variant else "."),
             "",
             "| " + " | ".join(head) + " |",
             "|" + "|".join(["---"] * 2 + ["---:"] * (len(head) - 4) + ["---", "---:"]) + "|"]
    for run in runs:
        name = run.name + ("*" if spec.baseline_variant and run.variant == spec.baseline_variant else "")
        reached = run.time_to(spec.primary, spec.target)
        if reached is not None:
            to_target = f"{reached.step}" + (f" ({format_seconds(reached.seconds)})" if reached.seconds is not None else "")
        else:
            to_target = "not reached" if run.last(spec.primary) is not None else ""
        cells = [name, what_changes(group, run), format_value(spec.primary, run.last(spec.primary)),
                 format_value(spec.primary, run.best(spec.primary)),
                 *(format_value(k, run.last(k)) for k in columns), run.status or "", to_target]
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    missing = [v for v in _variants(group) if v not in {r.variant for r in runs}]
    if missing:
        lines += ["", "Not run: " + ", ".join(missing) + "."]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------------- plots


def plot_filename(group: str, n: int, plot: Plot) -> str:
    return f"{group}_{n}_{plot.y.replace('/', '_')}.png"


def _x_label(plot: Plot) -> str:
    return {"params": "parameters", "step": "step", "variant": "variant"}.get(plot.x, plot.x)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _draw(ax, group: str, plot: Plot, runs: list[Run]) -> list[str]:
    """Draw `plot` on `ax`; returns notes on the runs left out."""
    spec = GROUPS[group]
    is_base = {r.name: spec.baseline_variant is not None and r.variant == spec.baseline_variant for r in runs}
    notes: list[str] = []
    # A curve of an eval/ metric (the whole eval set) also draws the run's intermediate evaluations
    # on a subset (eval_subset/, train.eval_subset) as a dashed line of their own: never one line.
    subset_y = f"eval_subset/{plot.y[len('eval/'):]}" if plot.x == "step" and plot.y.startswith("eval/") else None
    no_y = [r.name for r in runs if r.last(plot.y) is None and (subset_y is None or r.last(subset_y) is None)]
    if no_y:
        notes.append(f"no {plot.y}: {', '.join(no_y)}")
    if plot.x == "step":
        have = [r for r in runs if r.name not in no_y]
        for i, r in enumerate(have):
            label = r.name + (" (baseline)" if is_base[r.name] else "")
            for key, style, shown in ((plot.y, "-", label), (subset_y, "--", label + " (subset)")):
                pts = [(s, v) for s, v in r.curve(key) if not plot.log_x or s > 0] if key else []
                if not pts:
                    continue
                xs, ys = zip(*pts)
                if is_base[r.name]:
                    ax.plot(xs, ys, color="black", linewidth=2.5, linestyle=style, marker="o" if len(xs) == 1 else None,
                            label=shown, zorder=3)
                else:
                    ax.plot(xs, ys, color=f"C{i % 10}", linewidth=1.3, linestyle=style,
                            marker="." if len(xs) < 30 else None, label=shown)
        if have:
            ax.legend(fontsize=8, loc="best")
        return notes

    # one value per run, the last; a diverged run (nan) is named, not drawn
    have = [r for r in runs if _is_number(r.last(plot.y))]
    bad = [r.name for r in runs if r.last(plot.y) is not None and not _is_number(r.last(plot.y))]
    if bad:
        notes.append(f"{plot.y} not finite: {', '.join(bad)}")
    if plot.x == "variant":
        _bars(ax, have, [r.name for r in have], plot.y, is_base)
        return notes

    # x from each run: its parameter count or a config value
    points, other = [], []
    for r in have:
        x = r.last(PARAMS) if plot.x == "params" else r.config_value(plot.x)
        if _is_number(x) and (not plot.log_x or x > 0):
            points.append((x, r.last(plot.y), r))
        else:
            other.append((x, r))
    if not points and other:  # no numeric x at all (e.g. strings): one bar per run, labelled with its x
        runs_ = [r for _, r in other]
        _bars(ax, runs_, [f"{r.name}\n{plot.x}={_short_value(x)}" for x, r in other], plot.y, is_base)
        return notes
    points.sort(key=lambda p: p[0])
    means: dict[float, list[float]] = {}  # by x, in x order (points are sorted)
    for x, y, _ in points:
        means.setdefault(x, []).append(y)
    if len(means) > 1:
        ax.plot(list(means), [sum(ys) / len(ys) for ys in means.values()], color="C0", linewidth=1.2, zorder=1)
    for x, y, r in points:
        base = is_base[r.name]
        ax.scatter([x], [y], s=90 if base else 36, color="C3" if base else "C0", marker="*" if base else "o",
                   zorder=3, edgecolors="black" if base else "none")
        ax.annotate(r.name + (" (baseline)" if base else ""), (x, y), textcoords="offset points", xytext=(4, 4),
                    fontsize=7, fontweight="bold" if base else "normal")
    if plot.x == "params":
        notes += [f"no {PARAMS}: {r.name}" for _, r in other]
    elif other:
        for i, (x, r) in enumerate(other):  # e.g. ema_rate null: a labelled horizontal line
            ax.axhline(r.last(plot.y), color=f"C{(i + 1) % 10}", linestyle="--", linewidth=1.2,
                       label=f"{r.name} ({plot.x}={_short_value(x)})")
        ax.legend(fontsize=8, loc="best")
    if points:
        if plot.log_x:
            ax.set_xscale("log")
        ax.margins(x=0.08)
        if plot.log_x and plot.x != "params" and len(means) <= 12:  # config values over decades: a tick at each
            from matplotlib.ticker import NullLocator  # optional heavy, as in `make_figure`

            ax.set_xticks(list(means), [_g(x) for x in means])
            ax.xaxis.set_minor_locator(NullLocator())
    return notes


def _bars(ax, runs: list[Run], labels: list[str], y: str, is_base: dict[str, bool]) -> None:
    values = [r.last(y) for r in runs]
    pos = list(range(len(runs)))
    bars = ax.bar(pos, values, color=["C3" if is_base[r.name] else "C0" for r in runs],
                  edgecolor=["black" if is_base[r.name] else "none" for r in runs])
    for bar, v in zip(bars, values):
        ax.annotate(format_value(y, v), (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    textcoords="offset points", xytext=(0, 2), ha="center", fontsize=7)
    ax.set_xticks(pos)
    ax.set_xticklabels([lab + (" *" if is_base[r.name] else "") for lab, r in zip(labels, runs)],
                       rotation=30, ha="right", fontsize=8)


def make_figure(group: str, p: Plot, runs: Iterable[Run]):
    """The matplotlib Figure (Agg canvas, no pyplot) of plot `p` of `group` over `runs`."""
    # matplotlib is optional heavy (1.8 s): only drawing loads it. No pyplot: no global backend state, no display
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    spec = GROUPS[group]
    runs = ordered(group, runs)
    fig = Figure(figsize=(8, 5), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    notes = _draw(ax, group, p, runs)
    if not any(r.last(p.y) is not None for r in runs):
        ax.text(0.5, 0.5, f"no run logged {p.y}", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel(_x_label(p) + (" (log)" if p.log_x else ""))
    ax.set_ylabel(p.y)
    ax.set_title(f"{group} ({spec.title}): {p.title or f'{p.y} vs {_x_label(p)}'}", fontsize=11)
    ax.grid(True, alpha=0.3)
    if notes:
        fig.text(0.01, 0.005, "; ".join(notes), fontsize=7, color="gray", va="bottom")
    fig.tight_layout(rect=(0, 0.03 if notes else 0, 1, 1))
    return fig


def plot(group: str, runs: Iterable[Run], out_dir: str | Path) -> list[Path]:
    """One PNG per Plot of the group's spec, into `out_dir`; returns their paths."""
    runs = ordered(group, runs)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for n, p in enumerate(GROUPS[group].plots, 1):
        path = out / plot_filename(group, n, p)
        with replacing(path) as tmp:  # a picture whole or not at all, as the page
            make_figure(group, p, runs).savefig(tmp, format="png")
        paths.append(path)
    return paths


def analyze(group: str, runs: Iterable[Run], out_dir: str | Path | None = None, *,
            root: str | Path = "outputs") -> tuple[Path, list[Path]]:
    """Write `<out_dir>/<group>.md` (the table, then the plots) and the PNGs.
    `out_dir` defaults to `<root>/<group>/analysis`."""
    runs = ordered(group, runs)
    out = Path(out_dir) if out_dir is not None else Path(root) / group / "analysis"
    pngs = plot(group, runs, out)
    parts = [table(group, runs), *(f"![{p.title or p.y}]({path.name})\n" for p, path in zip(GROUPS[group].plots, pngs))]
    md = out / f"{group}.md"
    write_atomic(md, "\n".join(parts))  # whole or not at all: an earlier analysis stays until this one is written
    return md, pngs


# ------------------------------------------------------------------------------------- CLI


def _no_runs_message(group: str, root: str) -> str:
    msg = f"no runs of {group} under {Path(root) / group}; run `python experiments/launch.py sweep {group} --local` first or pass --root"
    local = Path(root) / "local" / group
    if local.is_dir() and any((d / METRICS_FILE).is_file() for d in local.iterdir()):
        msg += f" (there are runs under {local}: --root {Path(root) / 'local'})"
    return msg


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="launch.py analyze", description=(__doc__ or "").split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("group", metavar="GROUP", help=f"experiment group: {', '.join(GROUPS)}")
    p.add_argument("--root", default="outputs", help="run.root the runs were written under (default: %(default)s; "
                   "scaled-down local runs: outputs/local)")
    p.add_argument("--wandb", metavar="PROJECT", default=None, help="read the runs from this W&B project instead")
    p.add_argument("--entity", default=None, help="W&B entity of --wandb PROJECT (default: your default entity)")
    p.add_argument("--out", type=Path, default=None, help="output directory (default: <root>/<group>/analysis)")
    return p


def main(argv: list[str] | None = None) -> int:
    try:  # a broken group file (GroupFileError) too: it is a UserError
        args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
        if args.group not in GROUPS:
            raise UserError(f"unknown group {args.group!r}; pick one of {', '.join(GROUPS)}")
        if args.entity and not args.wandb:
            raise UserError("--entity needs --wandb PROJECT")
        if args.wandb:
            try:
                runs = collect_wandb(args.group, args.wandb, args.entity)
            except Exception as e:  # network, login, unknown project: one line
                detail = " ".join(str(e).split())[:200]
                raise UserError(f"could not read W&B project {args.wandb!r}: {type(e).__name__}: {detail}; "
                                "check `wandb login` / WANDB_API_KEY and --entity") from e
            if not runs:
                where = f"{args.entity}/{args.wandb}" if args.entity else args.wandb
                raise UserError(f"no W&B runs with group={args.group} in {where}; check the project and --entity, "
                                "or read local runs with --root")
        else:
            runs = collect_local(args.group, args.root)
            if not runs:
                raise UserError(_no_runs_message(args.group, args.root))
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR
    md, pngs = analyze(args.group, runs, args.out, root=args.root)
    print(table(args.group, runs))
    print(f"wrote {md}")
    for path in pngs:
        print(f"wrote {path}")
    return 0
