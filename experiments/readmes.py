"""Write each group's README.md from its group.yaml, and docs/RESULTS.md from docs/results/.

    python -m experiments.readmes            # write every generated doc
    python -m experiments.readmes --check    # exit 1 naming each one that differs (CI, tests)

A group README holds only what is the group's own: its `readme:` facts in group.yaml (the
hypothesis, the expected result, the data, the plan-first hint, the scaled-down note, its own W&B
keys), its variants as `launch.py list` computes them, its plots as `analyze` names them, and
its cost from docs/results/ (the measurement `plan`). What every group shares is said once, in
docs/EXPERIMENTS.md ("Running a group"), and linked. The common W&B keys come from
experiments/programme.py `WANDB_KEYS`.

docs/RESULTS.md is every measured figure the docs quote: each data file of docs/results/ is one
measurement, stamped with the command that made it, its commit and its date.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from experiments.dashboard import family
from experiments.dashboard import view_name as dashboard_name
from experiments.programme import EXPERIMENTS_DIR, GROUPS, WANDB_KEYS, Group, GroupFileError, Plot, variant_files
from runtime.errors import EXIT_FAILURE, EXIT_USER_ERROR

REPO = EXPERIMENTS_DIR.parent
RESULTS_DIR = REPO / "docs" / "results"
RESULTS_MD = REPO / "docs" / "RESULTS.md"
COMMAND = "python -m experiments.readmes"
SHARED = "../../docs/EXPERIMENTS.md#running-a-group"

# readme: facts every group.yaml states (what each says: docs/EXPERIMENTS.md, "Adding a group")
REQUIRED = ("summary", "hypothesis", "expected", "data", "plan_variant", "plan_note", "local", "watch")
OPTIONAL = ("heading", "run_note", "eval_note")

# The overrides a pod run of each family needs (where its checkpoints, weights and data live).
POD_OVERRIDES = {
    "trm": ('run.wandb.mode=online "run.checkpoint.dir=gs://$BUCKET/runs/\\${hydra:runtime.choices.experiment}"',),
    "gemma": ('run.wandb.mode=online "arch.checkpoint=gs://$BUCKET/gemma/\\${arch.name}"'
              ' "data.path=gs://$BUCKET/sft/traces-v\\${arch.version}-seq\\${data.seq_len}"'
              ' "data.tokenizer=gs://$BUCKET/gemma/\\${arch.name}/tokenizer.model"'
              ' "run.checkpoint.dir=gs://$BUCKET/runs/\\${hydra:runtime.choices.experiment}"',),
}
GEMMA_V4_64 = "mesh.data=-1 mesh.fsdp=8 train.global_batch_size=64"  # the layout of gemma_sft/gemma2b_full_v4_64


def check_facts(group: Group) -> None:
    """GroupFileError naming each missing or unknown README fact of the group's group.yaml."""
    where = f"experiments/{group.name}/group.yaml"
    facts = group.readme
    missing = [k for k in REQUIRED if k not in facts]
    unknown = sorted(set(facts) - set(REQUIRED) - set(OPTIONAL))
    if missing or unknown:
        raise GroupFileError(f"{where}: readme: " + "; ".join(
            ([f"missing fact(s) {missing}"] if missing else []) + ([f"unknown fact(s) {unknown}"] if unknown else []))
            + f"; the facts are {list(REQUIRED)} and optionally {list(OPTIONAL)} (docs/EXPERIMENTS.md, \"Adding a group\")")
    for key in REQUIRED + OPTIONAL:
        if key in facts and key != "watch" and (not isinstance(facts[key], str) or not facts[key].strip()):
            raise GroupFileError(f"{where}: readme.{key} must be non-empty text, got {facts[key]!r}")
    watch = facts["watch"]
    if not isinstance(watch, dict) or not all(isinstance(k, str) and isinstance(v, str) and v for k, v in watch.items()):
        raise GroupFileError(f"{where}: readme.watch must map each W&B key of the group's own to what it shows "
                             f"({{}} when it has none), got {watch!r}")
    if facts["plan_variant"] not in variant_files(group.name):
        raise GroupFileError(f"{where}: readme.plan_variant {facts['plan_variant']!r} is not a variant; "
                             f"the variants are {variant_files(group.name)}")


def _key(name: str) -> str:
    return name if "`" in name else f"`{name}`"


def _value(value: Any) -> str:
    from experiments.compose import _short
    return _short(value)


def variant_lines(group: Group) -> list[str]:
    """What `launch.py list GROUP` prints, as a list: each variant and what it changes."""
    from experiments.compose import changes, variants  # here: it imports Hydra
    out = []
    for v in variants(group.name):
        change = changes(group.name, v)
        said = ", ".join(f"`{k}={_value(x)}`" for k, x in change.items()) or "nothing: the base itself"
        out.append(f"- `{v}`{' (baseline)' if v == group.baseline_variant else ''}: {said}")
    return out


def plot_lines(group: Group) -> list[str]:
    """The PNGs `analyze GROUP` writes (experiments/analyze.py `plot_filename`) and what each plots."""
    from experiments.analyze import _x_label, plot_filename
    def against(p: Plot) -> str:
        return _x_label(p) if p.x in ("params", "step", "variant") else f"`{p.x}`"
    return [f"- `{plot_filename(group.name, n, p)}`: {p.title or f'`{p.y}` against {against(p)}'}"
            f"{' (log x)' if p.log_x else ''}" for n, p in enumerate(group.plots, 1)]


def plan_results() -> dict[str, Any]:
    """The plan's tables (docs/results/, the measurement `plan`) by group: {group: table}."""
    from experiments.results import measurement
    return {t["id"]: t for t in measurement("plan")["tables"]}


def cost_line(group: Group, plan: dict[str, Any]) -> str:
    g = group.name
    if g not in plan:
        return (f"**What {g} costs:** `python experiments/launch.py plan {g} --topology v5e-8 --mtbf 8h -- "
                f"data.path=<the built SFT set>` prices it once its set is built "
                f"([why not before](../../docs/EXPERIMENTS.md#gemma-groups)).")
    table = plan[g]
    total = dict(zip(table["columns"], next(r for r in table["rows"] if r[0] == g)))
    line = (f"**What {g} costs on a v4-64:** **{total['total_h']}** pod-hours at {total['goodput']} goodput, "
            f"of which evaluation {total['eval_h']}")
    if "eval_full_h" in table:
        line += (f" (the whole test set at every evaluation, `-- train.eval_subset=null`, would cost "
                 f"{table['eval_full_h']})")
    line += f"; every variant's row and how it was priced: [docs/RESULTS.md](../../docs/RESULTS.md#{g})."
    note = group.readme.get("eval_note")
    return line + (f" Evaluation: {note}" if note else "")


def render(group: Group, plan: dict[str, Any]) -> str:
    """The README of `group`, whole."""
    check_facts(group)
    f, g, fam = group.readme, group.name, family(group)
    overrides = POD_OVERRIDES[fam][0]
    one = (group.example_variants or (group.baseline_variant,) or tuple(variant_files(g)))[0]
    topology = "v5e-8" if fam == "gemma" else "v4-64"
    plan_cmds = [f"    python pretrain_jax.py +experiment={g}/{f['plan_variant']} compile_only={topology}"]
    if fam == "gemma":
        plan_cmds.append(f"    python pretrain_jax.py +experiment={g}/{f['plan_variant']} compile_only=v4-64 {GEMMA_V4_64}")
    if f["data"] == "baseline":
        data = (f"{g} trains on the baseline set `sudoku-extreme-1000-aug-1000`, built once as in "
                f"[docs/SETUP.md](../../docs/SETUP.md#4-datasets).")
    else:
        data = f["data"]
    own = [f"- {_key(k)}: {v}" for k, v in f["watch"].items()]
    parts = [
        f"# {g}: {f.get('heading', group.title)}",
        f["summary"],
        f"*Generated from [group.yaml](group.yaml) by `{COMMAND}`; what every group shares (set-up, the "
        f"commands' options, the W&B keys every run logs, the analysis) is in [docs/EXPERIMENTS.md]({SHARED}).*",
        f"**Hypothesis.** {f['hypothesis']}",
        f"**Expected result.** {f['expected']}",
        f"**Variants of {g}**, as `python experiments/launch.py list {g}` composes them against `{group.base}`:",
        "\n".join(variant_lines(group)),
        f"**Data for {g}:** {data}",
        *( [f["run_note"]] if "run_note" in f else [] ),
        f"**Plan {g} first** (no TPU needed; what the plan prints: [docs/EXPERIMENTS.md]({SHARED})):",
        "\n".join(plan_cmds),
        f["plan_note"],
        f"**Run {g} on a {topology}**{' (on a v4-64 add `' + GEMMA_V4_64 + '`)' if fam == 'gemma' else ''}: "
        f"every variant, one supervised pod run after another (a programme of one group), or one variant:",
        f"    python experiments/launch.py programme submit {g} {g} --slice $TPU --zone $ZONE --accelerator-type "
        f"{topology} --runtime-version tpu-ubuntu2204-base --run -- {overrides}\n"
        f"    python experiments/launch.py pod --tpu $TPU --zone $ZONE -- +experiment={g}/{one} {overrides}",
        cost_line(group, plan),
        f"**Run {g} scaled down here**, every variant on this machine's CPU under `outputs/local/{g}/`:",
        f"    python experiments/launch.py sweep {g} --local",
        f["local"],
        f"**Watch {g} in W&B:** project `podrunner`, group `{g}`, one run per variant; beside the keys every run "
        f"logs ([docs/EXPERIMENTS.md](../../docs/EXPERIMENTS.md#what-to-watch-in-wb)), "
        + ("this group's own, or what a common key shows here:" if own else "it has none of its own."),
        *(["\n".join(own)] if own else []),
        f"**Open {g}'s dashboard:** `python experiments/launch.py dashboard {g}` makes (or updates in place) a saved "
        f"W&B workspace `{dashboard_name(group, None)}` and a report of the same name, with these keys, the primary metric per "
        f"variant and the plots below as live panels, and prints both links; `--dry-run` writes their specs under "
        f"`<root>/{g}/analysis/` instead ([docs/SETUP.md](../../docs/SETUP.md#weights--biases)).",
        f"**Analyse {g}**, from W&B or from the local runs, into `<root>/{g}/analysis/{g}.md`: a row per run with "
        f"{', '.join(f'`{m}`' for m in (group.primary, *group.extra_metrics))} and the step that reached {group.target:g}; "
        f"then its plots:",
        f"    python experiments/launch.py analyze {g} --wandb podrunner\n"
        f"    python experiments/launch.py analyze {g} --root outputs/local",
        "\n".join(plot_lines(group)),
    ]
    if (EXPERIMENTS_DIR / g / "example.png").is_file():
        parts.append(f"![{g}'s plots from a few steps of its local sweep: the form of the analysis, not a result](example.png)")
    return "\n\n".join(p.strip("\n") for p in parts) + "\n"


EXPERIMENTS_MD = REPO / "docs" / "EXPERIMENTS.md"
BLOCK = ("<!-- generated: WANDB_KEYS -->\n", "<!-- end generated -->\n")


def with_wandb_keys(text: str) -> str:
    """docs/EXPERIMENTS.md with its table of WANDB_KEYS (between the BLOCK markers) written afresh."""
    head, _, rest = text.partition(BLOCK[0])
    _, _, tail = rest.partition(BLOCK[1])
    rows = ["| family | key | what it shows |", "|---|---|---|"]
    rows += [f"| {fam} | `{key}` | {shows} |" for fam, keys in WANDB_KEYS.items() for key, shows in keys]
    return head + BLOCK[0] + "\n".join(rows) + "\n" + BLOCK[1] + tail


def generated() -> dict[Path, str]:
    """Every generated doc: its path and what the generator writes there."""
    from experiments.results import render_results
    plan = plan_results()
    out = {EXPERIMENTS_DIR / name / "README.md": render(GROUPS[name], plan) for name in GROUPS}
    out[RESULTS_MD] = render_results()
    out[EXPERIMENTS_MD] = with_wandb_keys(EXPERIMENTS_MD.read_text())
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.readmes", description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="write nothing; name each doc that differs, and fail")
    args = p.parse_args(argv)
    try:
        docs = generated()
    except GroupFileError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR
    stale = [path for path, text in docs.items() if not path.is_file() or path.read_text() != text]
    if args.check:
        for path in stale:
            print(f"error: {path.relative_to(REPO)} differs from what its sources make; run `{COMMAND}`", file=sys.stderr)
        return EXIT_FAILURE if stale else 0
    for path in stale:
        path.write_text(docs[path])
        print(f"wrote {path.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
