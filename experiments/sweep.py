"""`launch.py sweep GROUP --local`: a group's variants, scaled down, as ONE Hydra multirun.

    pretrain_jax.py -m hydra.searchpath=[file://<root>/sweeps/scaled] \
        +experiment=local/<group>/<v1>,local/<group>/<v2>,... run.group=<group> run.root=<root> [overrides]

Each variant's scaled-down settings differ and Hydra's sweeper takes the same overrides for every
job, so each `local/<group>/<variant>` is a generated experiment file (`compose.local_experiment`)
under `<root>/sweeps/scaled/experiment/`; the run is still `<root>/<group>/<variant>`.

A failed job ends the multirun, so the sweep starts a new one with the variants after it. Each
job's exit code is its run_manifest.json's (the process's for a job that died before writing one).
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from experiments.compose import local_experiment

REPO = Path(__file__).resolve().parent.parent
SCALED = "local"  # the experiment prefix of the generated files: +experiment=local/<group>/<variant>


@dataclass(frozen=True)
class Job:
    variant: str
    run: str  # the run's name (its folder under <root>/<group>/: the variant, plus a suffix in a sweep of other keys)
    code: int | None  # exit code; None: not run (--dry-run)


def write_scaled(group: str, variants: list[str], root: Path) -> Path:
    """Write `<root>/sweeps/scaled/experiment/local/<group>/<variant>.yaml`; returns the search-path folder."""
    searchpath = (root / "sweeps" / "scaled").resolve()
    folder = searchpath / "experiment" / SCALED / group
    folder.mkdir(parents=True, exist_ok=True)
    for variant in variants:
        (folder / f"{variant}.yaml").write_text(local_experiment(group, variant))
    return searchpath


def _fresh_manifests(root: Path, group: str, since: float) -> dict[str, dict]:
    """{run name: manifest} of the runs of `group` whose manifest was written after `since`."""
    out = {}
    for path in sorted((root / group).glob("*/run_manifest.json")):
        if path.stat().st_mtime >= since:
            try:
                out[path.parent.name] = json.loads(path.read_text())
            except (OSError, json.JSONDecodeError):
                out[path.parent.name] = {}
    return out


def _runs_of(variant: str, variants: list[str], names: list[str]) -> list[str]:
    """The runs named after `variant` (itself, or itself + a sweep suffix), not after a longer variant."""
    longer = [v for v in variants if v != variant and v.startswith(variant)]
    return [n for n in names if (n == variant or n.startswith(variant + "_"))
            and not any(n == v or n.startswith(v + "_") for v in longer)]


def run_local(group: str, variants: list[str], root: Path, overrides: list[str], dry_run: bool = False,
              call: Callable[[list[str]], int] | None = None) -> list[Job]:
    """Run the variants as Hydra multiruns (a new one after a failed job); every job's exit code."""
    call = call or (lambda cmd: subprocess.call(cmd, cwd=REPO))
    root = root if root.is_absolute() else REPO / root  # the runs go where the job (run in the repo) puts them
    searchpath = write_scaled(group, variants, root)
    jobs: list[Job] = []
    todo = list(variants)
    while todo:
        experiments = ",".join(f"{SCALED}/{group}/{v}" for v in todo)  # the multirun of the variants left
        cmd = [sys.executable, str(REPO / "pretrain_jax.py"), "-m", f"hydra.searchpath=[file://{searchpath}]",
               f"+experiment={experiments}", f"run.group={group}", f"run.root={root}", *overrides]
        print("$ " + " ".join(shlex.quote(c) for c in cmd[1:]), flush=True)
        if dry_run:
            return [Job(v, v, None) for v in todo]
        start = time.time() - 1  # file times may be coarser than the clock
        code = call(cmd)
        manifests = _fresh_manifests(root, group, start)
        done = _read_jobs(todo, variants, manifests, code)
        jobs += done
        ran = {j.variant for j in done}
        todo = [v for v in todo if v not in ran]
    return jobs


def _read_jobs(todo: list[str], variants: list[str], manifests: dict[str, dict], code: int) -> list[Job]:
    """The jobs one multirun of `todo` ran, in order, up to the one that ended it (exit `code`)."""
    jobs = []
    for variant in todo:
        runs = _runs_of(variant, variants, sorted(manifests))
        for name in runs:
            exit_code = manifests[name].get("exit_code")
            jobs.append(Job(variant, name, exit_code if isinstance(exit_code, int) else code or 1))
        if not runs:  # died before writing its manifest, or ran where we do not look (run.group/run.name overridden)
            jobs.append(Job(variant, variant, code))
        if code and (not runs or any(manifests[n].get("status") != "completed" for n in runs)):
            return jobs  # this job ended the multirun; the caller goes on with the variants after it
    if code:  # every job completed, yet the multirun failed (e.g. on exit): say so on the last one
        jobs[-1] = Job(jobs[-1].variant, jobs[-1].run, code)
    return jobs
