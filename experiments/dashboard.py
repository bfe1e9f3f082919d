"""Each experiment group's W&B dashboards, made from its group.yaml: a saved workspace and a report.

    python experiments/launch.py dashboard exp01 [exp02a ... | all] [--entity E] [--project P]
    python experiments/launch.py dashboard all --dry-run      # write the specs, send nothing

The facts are the ones the group's README and `analyze GROUP` use: `varies_keys` (the run set's
grouping), `plots` (live panels), the primary metric, the baseline, the `readme:` facts
(hypothesis, expected result, `watch`: the group's own W&B keys) and the family's common keys
(experiments/programme.py `WANDB_KEYS`). Both views are built with `wandb-workspaces`; a second
run updates them in place: their ids are kept in `<root>/<group>/analysis/dashboard.json`, and a
view of the same name on the server is taken over when that file is missing. `--dry-run` (or
WANDB_MODE=offline) writes each spec as JSON beside it instead.

Exit codes (runtime/errors.py): 0 made or written; 2 bad input (an unknown group, online without
a key, an entity or project the server refuses), with one `error:` line.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import threading
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # run as a script: make `experiments.*` importable
    sys.path.insert(0, str(REPO_ROOT))

from experiments.programme import GROUPS, WANDB_KEYS, Group, GroupFileError, Plot, groups_named, variant_files  # noqa: E402
from runtime.atomic import write_atomic  # noqa: E402
from runtime.errors import EXIT_USER_ERROR, UserError, one_line  # noqa: E402

PROJECT = "podrunner"  # run.wandb.project's default (runtime/config.py)
REGISTRY = "dashboard{}.json"  # beside the group's analysis: the views' ids ("-TAG" for a programme's)
LOGGED_ONCE = ("model/params", "perf/compiled_temp_gib")  # WANDB_KEYS says "logged once": a bar per run, not a curve
# Cost: what the trainer writes to each run's summary (runtime/goodput.py `Timing.totals`).
COST_KEYS = ("time/goodput", "time/wall_s", "time/train_s", "time/eval_s", "time/steps_run")
OFFLINE_MODES = ("offline", "disabled", "dryrun")


def family(group: Group) -> str:
    """The group's family, the key of WANDB_KEYS (also experiments/readmes.py's)."""
    return "gemma" if group.base.startswith("gemma") else "trm"


def watch_keys(name: str) -> list[str]:
    """The W&B keys a `readme.watch` entry names: the entry itself, or each `quoted` key in it
    ("`train/L_cycles`, `train/H_cycles`", "`eval/exact_accuracy` curve")."""
    return re.findall(r"`([^`]+)`", name) if "`" in name else [name]


def common_keys(group: Group) -> list[str]:
    """The family's keys (the README's shared table), less the primary metric (its own section)."""
    return [k for k, _ in WANDB_KEYS[family(group)] if k != group.primary]


def own_keys(group: Group) -> list[str]:
    """The group's own keys, as its README's W&B table lists them."""
    return list(dict.fromkeys(k for entry in group.readme.get("watch", {}) for k in watch_keys(entry)))


def grouping(group: Group) -> list[str]:
    """The config keys the runs are grouped by: `varies_keys`, a preset swap (`arch`, `data`) by its name."""
    return [k if "." in k else f"{k}.name" for k in group.varies_keys]


def view_name(group: Group, tag: str | None) -> str:
    return f"{group.name}: {group.title}" + (f" [{tag}]" if tag else "")


# ------------------------------------------------------------------------------------ specs


def _filters(group: Group, tag: str | None) -> str:
    # The string form both models accept: W&B's group, and the programme's tag (queue_state.overrides_of).
    return f"Metric('Group') = '{group.name}'" + (f" and Tags('tags') in ['{tag}']" if tag else "")


def _plot_panel(p: Plot) -> Any:
    """A `plots` entry of group.yaml as the live panel `analyze` draws as a PNG."""
    import wandb_workspaces.reports.v2 as wr

    title = p.title or f"{p.y} vs {p.x}"
    if p.x == "step":
        return wr.LinePlot(title=title, y=[p.y], log_x=p.log_x or None)
    if p.x == "variant":
        return wr.BarPlot(title=title, metrics=[p.y], groupby_aggfunc="mean", groupby_rangefunc="stderr")
    x = "model/params" if p.x == "params" else p.x
    axis = wr.SummaryMetric(x) if p.x == "params" else wr.Config(x)
    return wr.ScatterPlot(title=title, x=axis, y=wr.SummaryMetric(p.y), log_x=p.log_x or None)


def _curve(key: str) -> Any:
    import wandb_workspaces.reports.v2 as wr

    if key in LOGGED_ONCE:
        return wr.BarPlot(title=key, metrics=[key])
    return wr.LinePlot(title=key, y=[key], groupby_aggfunc="mean", groupby_rangefunc="stderr")


def sections(group: Group, unlogged: tuple[str, ...] = ()) -> dict[str, list[Any]]:
    """The panels, by section: the primary metric, the group's plots, its own keys, the common ones, the
    cost; none for a key of group.yaml in `unlogged` (that the group's runs do not log)."""
    import wandb_workspaces.reports.v2 as wr

    primary = [wr.LinePlot(title=f"{group.primary} per variant", y=[group.primary], groupby_aggfunc="mean",
                           groupby_rangefunc="stderr"),
               wr.BarPlot(title=f"final {group.primary} per variant (mean, stderr over seeds)", metrics=[group.primary],
                          groupby_aggfunc="mean", groupby_rangefunc="stderr"),
               *(wr.ScatterPlot(title=f"final {group.primary} vs {k}", x=wr.Config(k), y=wr.SummaryMetric(group.primary))
                 for k in group.varies_keys[:1] if "." in k)]  # a number to put on an axis (not a preset's name)
    return {"primary metric": primary,
            "the group's plots (analyze)": [_plot_panel(p) for p in group.plots if p.y not in unlogged],
            "the group's own keys": [_curve(k) for k in own_keys(group) if k not in unlogged],
            "common metrics": [_curve(k) for k in common_keys(group) if k not in own_keys(group)],
            "cost": [wr.BarPlot(title=k, metrics=[k]) for k in COST_KEYS]}


def _columns(group: Group) -> list[str]:
    return ["run:state", f"summary:{group.primary}", *(f"config:{k}" for k in grouping(group)),
            "summary:time/goodput", "summary:time/wall_s"]


def workspace(group: Group, entity: str, project: str, tag: str | None = None, unlogged: tuple[str, ...] = ()) -> Any:
    """The group's saved workspace (not yet saved)."""
    import wandb_workspaces.workspaces as ws

    return ws.Workspace(
        entity=entity, project=project, name=view_name(group, tag),
        sections=[ws.Section(name=n, panels=panels, is_open=True)
                  for n, panels in sections(group, unlogged).items() if panels],
        runset_settings=ws.RunsetSettings(filters=_filters(group, tag),
                                          groupby=[ws.Config(k) for k in grouping(group)],
                                          pinned_columns=_columns(group)))


def report(group: Group, entity: str, project: str, tag: str | None = None, analysis: str | None = None,
           unlogged: tuple[str, ...] = ()) -> Any:
    """The group's report: its README's facts, the analysis table, its plots as live panels."""
    import wandb_workspaces.reports.v2 as wr

    f = group.readme
    # No entity/project of its own: the run set is the report's project's (and needs no server to build).
    runset = wr.Runset(name=group.name, filters=_filters(group, tag),
                       groupby=[f"config.{k}" for k in grouping(group)], pinned_columns=_columns(group))
    variants = "\n".join(f"- `{v}`" + (" (baseline)" if v == group.baseline_variant else "") for v in variant_files(group.name))
    table = analysis or (f"No analysis yet: `python experiments/launch.py analyze {group.name} --wandb {project}` "
                         f"writes the table (the primary metric, the step that reached {group.target:g}, status).")
    said = f"They vary {group.varies} (`{'`, `'.join(group.varies_keys)}`); what each changes: the group's README."
    blocks: list[Any] = [wr.MarkdownBlock(text=f.get("summary", ""))]
    for heading, text in (("Hypothesis", f.get("hypothesis", "")), ("Variants", f"{said}\n\n{variants}"),
                          ("Expected result", f.get("expected", "")), ("Analysis", table)):
        blocks += [wr.H2(text=heading), wr.MarkdownBlock(text=text)]
    panels = list(sections(group, unlogged).items())  # the analysis's panels first, under its table; then the rest
    blocks.append(wr.PanelGrid(runsets=[runset], panels=panels[0][1] + panels[1][1]))
    for heading, grid in panels[2:]:
        if grid:
            blocks += [wr.H2(text=heading[0].upper() + heading[1:]), wr.PanelGrid(runsets=[runset], panels=grid)]
    return wr.Report(entity=entity, project=project, title=view_name(group, tag)[:128],
                     description=f"{group.name}: made from experiments/{group.name}/group.yaml", blocks=blocks)


def specs(ws_: Any, rp: Any) -> dict[str, Any]:
    """What `.save()` sends for each view, as JSON-able objects."""
    return {"workspace": json.loads(ws_._to_model().model_dump_json(by_alias=True, exclude_none=True)),
            "report": json.loads(rp._to_model().model_dump_json(by_alias=True, exclude_none=True))}


# ------------------------------------------------------------------------------------ saving


def analysis_dir(root: str, group: str) -> Path:
    return Path(root) / group / "analysis"  # analyze.py's default out


def read_registry(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        raise UserError(f"cannot read {path} ({one_line(e)[:120]}); delete it to find the views by name") from e
    return data if isinstance(data, dict) else {}


# W&B's GraphQL: the project's views of one type (tests/test_layout.py exempts this file's `$name`s from its
# shell-variable rule: they are GraphQL's variables).
VIEWS = ("query DashboardViews($entityName: String, $name: String, $viewType: String) { "
         "project(name: $name, entityName: $entityName) { allViews(viewType: $viewType) "
         "{ edges { node { id name displayName } } } } }")


def find_view(entity: str, project: str, view_type: str, display_name: str) -> dict[str, str] | None:
    """The project's view of that type and name ({id, name}), or None."""
    import wandb
    from wandb_workspaces._graphql import execute_graphql

    data = execute_graphql(wandb.Api(), VIEWS, {"entityName": entity, "name": project, "viewType": view_type})
    edges = ((data.get("project") or {}).get("allViews") or {}).get("edges") or []
    return next(({"id": e["node"]["id"], "name": e["node"]["name"]} for e in edges
                 if e["node"].get("displayName") == display_name), None)


def unlogged(group: Group, entity: str, project: str) -> tuple[str, ...]:
    """The group's own keys and plotted metrics that none of its runs that evaluated (their summary
    holds the primary metric) has in its summary; none while no run has evaluated."""
    import wandb

    try:
        runs = list(wandb.Api().runs(f"{entity}/{project}", filters={"group": group.name}))
    except ValueError:  # wandb: no such project yet (its first runs make it): nothing to check
        return ()
    summaries = [set(dict(r.summary or {})) for r in runs]
    seen = set().union(*(s for s in summaries if group.primary in s))
    wanted = dict.fromkeys([*own_keys(group), *(p.y for p in group.plots)])
    return tuple(k for k in wanted if seen and k not in seen)


def save(group: Group, entity: str, project: str, tag: str | None, registry_path: Path, analysis: str | None,
         unlogged: tuple[str, ...] = ()) -> dict:
    """Create or update the group's two views; the registry is rewritten after each save."""
    ws_, rp = workspace(group, entity, project, tag, unlogged), report(group, entity, project, tag, analysis, unlogged)
    known = read_registry(registry_path)
    if (known.get("entity"), known.get("project")) != (entity, project):
        known = {}
    known.update(entity=entity, project=project)
    registry_path.parent.mkdir(parents=True, exist_ok=True)
    ids = known.get("workspace") or find_view(entity, project, "project-view", ws_.name)
    if ids:
        ws_._internal_id, ws_._internal_name = ids["id"], ids["name"]
    ws_.save()
    known["workspace"] = {"id": ws_._internal_id, "name": ws_._internal_name, "url": ws_.url}
    write_atomic(registry_path, json.dumps(known, indent=1) + "\n")
    ids = known.get("report") or find_view(entity, project, "runs", rp.title)
    if ids:
        rp.id = ids["id"]
    rp.save()
    known["report"] = {"id": rp.id, "url": rp.url}
    write_atomic(registry_path, json.dumps(known, indent=1) + "\n")
    return known


def _api_entity(entity: str | None) -> str:
    """The entity to save to; UserError when W&B has no key for this machine."""
    import wandb
    from wandb.sdk import wandb_setup
    from wandb.sdk.lib.wbauth import wbnetrc

    host = os.environ.get("WANDB_BASE_URL") or wandb_setup.singleton().settings.base_url
    if not (os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE")
            or wbnetrc.read_netrc_auth(host=host)):  # before wandb.Api(), which would wait for a prompt
        raise UserError(f"W&B is online but has no key for {host}: set WANDB_API_KEY (or `wandb login`), or write "
                        "the specs with --dry-run")
    try:
        api = wandb.Api()
    except (wandb.errors.UsageError, wandb.errors.AuthenticationError) as e:
        raise UserError("W&B is online but has no key: set WANDB_API_KEY (or `wandb login`), or write the specs with "
                        "--dry-run") from e
    who = entity or api.default_entity
    if not who:
        raise UserError("W&B names no default entity for this key; give --entity")
    return who


def run(names: list[str], *, entity: str | None, project: str, root: str, dry_run: bool, tag: str | None,
        out: Any = None) -> int:
    out = out or sys.stdout
    groups = [GROUPS[g] for g in groups_named(names)]
    offline = dry_run or os.environ.get("WANDB_MODE", "").lower() in OFFLINE_MODES
    if offline:
        for g in groups:
            folder = analysis_dir(root, g.name)
            made = specs(workspace(g, entity or "ENTITY", project, tag), report(g, entity or "ENTITY", project, tag))
            folder.mkdir(parents=True, exist_ok=True)
            for kind, spec in made.items():
                path = folder / f"dashboard_{kind}{f'-{tag}' if tag else ''}.json"
                write_atomic(path, json.dumps(spec, indent=1) + "\n")
                print(f"wrote {path} (the {kind} spec; nothing sent to W&B"
                      f"{'' if entity else '; entity ENTITY: give --entity'})", file=out)
        return 0
    who = _api_entity(entity)
    for g in groups:
        missing = unlogged(g, who, project)
        for key in missing:
            print(f"warning: {g.name}: no run of the group logs {key!r}, so it has no panel (check readme.watch and "
                  f"plots in experiments/{g.name}/group.yaml; run `dashboard {g.name}` again once a run logs it)",
                  file=sys.stderr)
        folder = analysis_dir(root, g.name)
        md = folder / f"{g.name}.md"
        # analyze's table (its PNG lines left out: the report has the plots live)
        table = "\n".join(x for x in md.read_text().splitlines() if not x.startswith("![")) if md.is_file() else None
        known = save(g, who, project, tag, folder / REGISTRY.format(f"-{tag}" if tag else ""), table, missing)
        print(f"{g.name}: workspace {known['workspace']['url']}\n{g.name}: report {known['report']['url']}", file=out)
    return 0


# --------------------------------------------------------------------------------- programme

PROGRAMME_DIR = "dashboards"  # in a programme's state directory: settings.json (opted in), <group>.json (the ids)


def programme_settings(runs_wandb: Any) -> dict[str, str]:
    """`programme submit --dashboards`: where the views go (the runs' W&B settings, `run.wandb`), checked
    before anything is saved: the runs log online, this machine has a key, the entity is known."""
    import wandb
    from wandb_workspaces._graphql import get_app_url

    if runs_wandb is None or str(getattr(runs_wandb.mode, "value", runs_wandb.mode)) != "online":
        raise UserError("--dashboards needs the runs to log to W&B online: add `run.wandb.mode=online` after `--`")
    who = _api_entity(runs_wandb.entity)
    return {"entity": who, "project": runs_wandb.project, "app_url": get_app_url(wandb.Api()).rstrip("/")}


def opt_in(state_dir: Path, settings: dict[str, str]) -> None:
    folder = Path(state_dir) / PROGRAMME_DIR
    folder.mkdir(parents=True, exist_ok=True)
    write_atomic(folder / "settings.json", json.dumps(settings, indent=1) + "\n")


def links(state_dir: Path) -> dict[str, Any] | None:
    """{"runs": the W&B run pages' prefix, "groups": {group: its workspace's URL}} of an opted-in programme, or None."""
    folder = Path(state_dir) / PROGRAMME_DIR
    try:
        settings = json.loads((folder / "settings.json").read_text())
    except (OSError, ValueError):
        return None
    groups = {}
    for path in sorted(folder.glob("*.json")):
        url = (read_registry(path).get("workspace") or {}).get("url") if path.name != "settings.json" else None
        if url:
            groups[path.stem] = url
    return {"runs": f"{settings['app_url']}/{settings['entity']}/{settings['project']}/runs/", "groups": groups}


class ProgrammeDashboards:
    """The controller's: each group's workspace and report, made when its first variant starts (in a
    thread of its own: W&B never holds a slice up), filtered to the programme's tag. A failure is one
    warning; the programme goes on."""

    def __init__(self, state_dir: Path, tag: str, settings: dict[str, str]) -> None:
        self.folder, self.tag, self.settings = Path(state_dir) / PROGRAMME_DIR, tag, settings
        self.begun: set[str] = set()

    @classmethod
    def of(cls, state_dir: Path, tag: str) -> ProgrammeDashboards | None:
        try:
            return cls(state_dir, tag, json.loads((Path(state_dir) / PROGRAMME_DIR / "settings.json").read_text()))
        except (OSError, ValueError):
            return None  # not opted in

    def started(self, variant: str) -> threading.Thread | None:
        group = variant.split("/", 1)[0]
        if group in self.begun or (self.folder / f"{group}.json").is_file() or group not in GROUPS:
            return None
        self.begun.add(group)
        thread = threading.Thread(target=self.make, args=(group,), name=f"dashboard-{group}", daemon=True)
        thread.start()
        return thread

    def make(self, group: str) -> None:
        try:
            save(GROUPS[group], self.settings["entity"], self.settings["project"], self.tag,
                 self.folder / f"{group}.json", None)
        except Exception as e:  # noqa: BLE001 - a dashboard never stops the programme
            print(f"WARNING the W&B dashboard of {group} was not made ({type(e).__name__}: {one_line(e)[:160]}); "
                  f"`launch.py dashboard {group} --programme-tag {self.tag}` makes it", file=sys.stderr, flush=True)


def refused(e: Exception) -> bool:
    """A W&B request the server refused or could not answer (not a bug of ours)."""
    import wandb

    names = {c.__name__ for c in type(e).__mro__}
    return isinstance(e, wandb.errors.Error) or "WandbApiFailedError" in names or "CommError" in names


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("groups", nargs="+", metavar="GROUP", help="experiment groups, or all")
    p.add_argument("--entity", default=None, help="W&B entity (default: your default entity)")
    p.add_argument("--project", default=PROJECT, help="W&B project of the runs (default: %(default)s)")
    p.add_argument("--root", default="outputs", help="run.root: the ids and specs go to <root>/<group>/analysis/")
    p.add_argument("--dry-run", action="store_true", help="write each spec as JSON; send nothing")
    p.add_argument("--programme-tag", default=None, metavar="NAME", help="only the runs of this programme (its tag)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="dashboard.py", description=(__doc__ or "").split("\n\n")[0])
    add_arguments(p)
    return main_args(p.parse_args(argv))


def main_args(args: argparse.Namespace) -> int:
    try:
        return run(args.groups, entity=args.entity, project=args.project, root=args.root, dry_run=args.dry_run,
                   tag=args.programme_tag)
    except (UserError, GroupFileError) as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    except Exception as e:  # noqa: BLE001 - a refused request is one line; anything else is a bug: raise
        if not refused(e):
            raise
        where = f"{args.entity + '/' if args.entity else ''}{args.project}"
        print(f"error: W&B refused the dashboard ({one_line(e)[:160]}); check that your key may write to {where} "
              "(--entity, --project), or use --dry-run", file=sys.stderr)
        return EXIT_USER_ERROR


if __name__ == "__main__":
    sys.exit(main())
