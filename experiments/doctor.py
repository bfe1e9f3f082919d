"""`launch.py doctor`: the first ten minutes on a slice. Every worker runs its checks and short
measurements (experiments/launcher/worker/doctor_checks.py) through the one `gcloud ... ssh
--worker=all` that `pod` uses; this side compares what the workers said (the same versions
everywhere, every worker answered), prints one verdict line per check and worker and a summary
table, writes the JSON file (`write_file`: every check, every figure, where and when, each figure
labelled with the platform it was measured on), and deletes the bucket's scratch prefix.

`plan --calibrate-from FILE` reads that file (experiments/plan/calibrate.py `from_doctor`).
Exit 0 only when every check passed (or does not apply there); EXIT_CHECK_FAILED otherwise.
"""

from __future__ import annotations

import json
import shlex
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence, TextIO

from experiments.launcher import gcloud, pod
from experiments.launcher.gcloud import PodError, Target
from experiments.launcher.worker import SECRETS_PREFIX
from experiments.launcher.worker.doctor_checks import BUDGETS, GROUPS, Spec
from runtime import wire
from runtime.errors import EXIT_CHECK_FAILED, EXIT_INTERRUPTED

FORMAT = 1  # the file's format (`format` in it)
BAD = ("fail", "overrun")
NOT_COMPARED = ("venv", "tree")  # a worker's own paths, not what the workers must agree on


@dataclass
class Outcome:
    """What the doctor found: each worker's report, the launcher's own verdicts, gcloud's exit code."""
    reports: list[wire.DoctorReport] = field(default_factory=list)
    checks: list[tuple[str, wire.Check]] = field(default_factory=list)  # (worker, verdict) found here
    code: int = 0
    workers: int = 0

    @property
    def ok(self) -> bool:
        return not any(c.status in BAD for _, c in self.every())

    def every(self) -> list[tuple[str, wire.Check]]:
        return [(r.worker or r.host, c) for r in self.reports for c in r.checks] + self.checks


def doctor_command(repo_dir: str, spec: Spec, secrets_file: str | None) -> str:
    """Worker command: from the repo, the secrets read into the environment and removed, then the checks."""
    steps = [f"cd {pod.remote_path(repo_dir)} || " + pod._fail("no repo at --repo-dir (run launch.py setup)")]
    secret = ["--secrets", pod.remote_path("~/" + secrets_file)] if secrets_file else []
    if secret:  # should the checks never start (no repo), the file goes with the ssh
        steps.insert(0, f"trap {shlex.quote('rm -f ' + secret[1])} EXIT")
    steps.append(pod.worker_call("doctor_checks", pod.HOST, shlex.quote(json.dumps(asdict(spec))), *secret))
    return "; ".join(steps)


def budget_s(spec: Spec) -> float:
    """The whole ssh's time: the budgets of the groups asked for, and a margin for the ssh itself."""
    groups = [g for g in GROUPS if g in spec.only]
    measure = spec.measure_budget * max(1, len(spec.variants)) + 10 if "measure" in groups else 0.0
    return sum(BUDGETS[g] for g in groups if g != "measure") + 2 * spec.port_wait + measure + 60.0


def budget_of(group: str, spec: Spec) -> float:
    return spec.measure_budget if group == "measure" else BUDGETS[group] + (2 * spec.port_wait if group == "ports" else 0)


def expected_workers(target: Target) -> tuple[int, str | None]:
    """(workers, accelerator type) of the slice from `gcloud describe`; PodError when it is not there."""
    code, out = gcloud.run_quiet(gcloud.describe_argv(target))
    if code != 0:
        auth = gcloud.auth_failure(out)
        raise PodError(auth + "; run `gcloud auth login`" if auth else
                       f"cannot describe TPU {target.tpu} in {target.zone}: {gcloud.error_line(out)}; check --tpu and "
                       "--zone (`gcloud compute tpus tpu-vm list`)")
    try:
        node = json.JSONDecoder().raw_decode(out, out.index("{"))[0]
    except ValueError:
        raise PodError(f"gcloud describe of {target.tpu} gave no JSON: {gcloud.error_line(out)}") from None
    if node.get("state") not in (None, "READY"):
        raise PodError(f"TPU {target.tpu} is {node.get('state')}, not READY; wait for it or recreate it")
    return len(node.get("networkEndpoints") or []), node.get("acceleratorType")


def run_doctor(target: Target, spec: Spec, *, repo_dir: str = pod.DEFAULT_REPO_DIR, out_file: Path,
               secret_env: dict[str, str], stream: TextIO | None = None, command: str = "") -> int:
    """The doctor's run (the module docstring); its exit code."""
    stream = stream or sys.stdout
    started = time.time()
    workers, accelerator = expected_workers(target)
    secrets_file = SECRETS_PREFIX + spec.scratch if secret_env else None
    _say(stream, f"doctor on {target.tpu} ({accelerator or 'accelerator type unknown'}, {workers} workers): "
                 f"{', '.join(g for g in GROUPS if g in spec.only)}; budget {budget_s(spec):.0f} s in all "
                 f"(per check: {', '.join(f'{g} {budget_of(g, spec):g} s' for g in GROUPS if g in spec.only)})")
    outcome = Outcome(workers=workers)
    if secrets_file:
        code = pod.send_secrets(target, secret_env, secrets_file, stream=stream)
        if code != 0:
            outcome.checks.append(("launcher", wire.Check("secrets", "fail", f"copying {', '.join(secret_env)} "
                                   f"to the workers failed (gcloud exit {code})", "check `launch.py status` reaches "
                                   "every worker")))
            secrets_file = None
    try:
        spec.sent = time.time()  # the workers measure the launch from it
        outcome.code = _ssh(target, doctor_command(repo_dir, spec, secrets_file), spec, outcome, stream)
    except KeyboardInterrupt:
        _say(stream, "interrupted: the workers' checks end with their ssh; `launch.py stop` makes sure the TPU is free")
        return EXIT_INTERRUPTED
    finally:
        _remove_scratch(spec, outcome)
    compare(outcome)
    for worker, check in verdicts(outcome):
        stream.write(verdict_line(worker, check) + "\n")
    stream.write(summary_table(outcome) + "\n")
    write_file(out_file, outcome, target=target, accelerator=accelerator, started=started, command=command)
    bad = sum(c.status in BAD for _, c in outcome.every())
    _say(stream, f"{'all checks passed' if not bad else f'{bad} check(s) failed'}; every check and figure in {out_file}")
    return 0 if outcome.ok else EXIT_CHECK_FAILED


def _say(stream: TextIO, message: str) -> None:
    stream.write(f"[doctor] {message}\n")
    stream.flush()


def _ssh(target: Target, command: str, spec: Spec, outcome: Outcome, stream: TextIO) -> int:
    """The one ssh to every worker, ended when the whole budget has passed (a worker that hangs)."""
    timer: list[threading.Timer] = []

    def started(proc: subprocess.Popen) -> None:
        timer.append(threading.Timer(budget_s(spec), gcloud.end, (proc,)))
        timer[0].daemon = True
        timer[0].start()

    def take(line: str) -> None:
        if (report := wire.doctor(line)) is not None:
            outcome.reports.append(report)

    try:
        return gcloud.run_streaming(gcloud.ssh_argv(target, command), stream=stream, on_line=take, started=started)
    finally:
        for t in timer:
            t.cancel()


def _remove_scratch(spec: Spec, outcome: Outcome) -> None:
    """The bucket's scratch prefix, whatever the workers left of it (each deletes its own objects)."""
    if not spec.bucket or not {"storage", "measure"} & set(spec.only):
        return
    prefix = f"{spec.bucket.rstrip('/')}/{spec.scratch}"
    try:
        import fsspec

        fs, _ = fsspec.core.url_to_fs(prefix)
        if fs.exists(prefix):
            fs.rm(prefix, recursive=True)
    except Exception as e:  # noqa: BLE001 - gcsfs raises many kinds: the line says which
        outcome.checks.append(("launcher", wire.Check("scratch-removed", "fail", f"could not delete {prefix} "
                               f"({type(e).__name__}: {str(e)[:200]})", f"delete it: `gcloud storage rm -r {prefix}`")))


def compare(outcome: Outcome) -> None:
    """The launcher's verdicts: every worker answered, and all report the same versions."""
    answered = {r.worker for r in outcome.reports}
    for i in range(outcome.workers):
        if str(i) not in answered:
            outcome.checks.append((str(i), wire.Check(
                "answered", "fail", f"worker {i} did not answer (gcloud exit {outcome.code})",
                f"check the worker is up: `gcloud compute tpus tpu-vm ssh --worker={i} ...`; recreate the slice if "
                "it does not answer")))
    rows = {r.worker or r.host: {k: v for k, v in r.versions.items() if k not in NOT_COMPARED}
            for r in outcome.reports if r.versions}
    if len({json.dumps(v, sort_keys=True) for v in rows.values()}) > 1:
        counts: dict[str, int] = {}
        for v in rows.values():
            counts[json.dumps(v, sort_keys=True)] = counts.get(json.dumps(v, sort_keys=True), 0) + 1
        common = json.loads(max(counts, key=lambda k: (counts[k], k)))
        for worker, row in sorted(rows.items()):
            differs = {k: v for k, v in row.items() if common.get(k) != v}
            if differs:
                said = ", ".join(f"{k} {v} (others {common.get(k)})" for k, v in differs.items())
                outcome.checks.append((worker, wire.Check("same-versions", "fail", f"this worker differs: {said}",
                                                          "run `launch.py setup` (--git-ref REF) so that every "
                                                          "worker has the same commit and pins")))
    elif rows:
        outcome.checks.append(("all", wire.Check("same-versions", "ok", f"{len(rows)} workers report the same "
                                                 "commit, Python and packages")))


def _order(worker: str) -> tuple:
    return (0, int(worker), "") if worker.isdigit() else (1, 0, worker)


def verdicts(outcome: Outcome) -> list[tuple[str, wire.Check]]:
    return sorted(outcome.every(), key=lambda wc: _order(wc[0]))


def verdict_line(worker: str, check: wire.Check) -> str:
    """`worker 1: FAIL tpu-free: pid 42 holds the TPU: ...; fix: launch.py stop ...`"""
    head = f"worker {worker}" if worker.isdigit() else worker
    line = f"{head}: {check.status.upper() if check.status in BAD else check.status} {check.name}: {check.detail}"
    return line + (f"; fix: {check.fix}" if check.status in BAD and check.fix else "")


def summary_table(outcome: Outcome) -> str:
    """Checks down, workers across: each cell the verdict."""
    cells: dict[str, dict[str, str]] = {}
    for worker, check in outcome.every():
        cells.setdefault(check.name, {})[worker] = check.status
    workers = sorted({w for row in cells.values() for w in row}, key=_order)
    table = [["check", *workers]] + [[name, *(row.get(w, "-") for w in workers)] for name, row in cells.items()]
    widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in table)


def platform_of(outcome: Outcome) -> str | None:
    """`tpu` or `cpu` (what the slice's devices were), `mixed`, or None when jax was not asked."""
    seen = {r.platform for r in outcome.reports if r.platform}
    return seen.pop() if len(seen) == 1 else ("mixed" if seen else None)


def write_file(path: Path, outcome: Outcome, *, target: Target, accelerator: str | None, started: float,
               command: str) -> None:
    """The JSON file: every check (worker, host, when), every figure (worker, host, platform, when) and
    `figures`, each of the plan's figures as the slowest worker measured it (a pod waits for its last)."""
    checks, figures = [], []
    for r in outcome.reports:
        where = {"worker": r.worker, "host": r.host, "time": r.time}
        checks += [{**asdict(c), **where} for c in r.checks]
        figures += [{**asdict(m), **where, "platform": r.platform} for m in r.figures]
    checks += [{**asdict(c), "worker": w, "host": None, "time": time.time()} for w, c in outcome.checks]
    summary: dict[str, dict] = {}
    for name in sorted({(f["name"], f["variant"]) for f in figures}, key=str):
        same = [f for f in figures if (f["name"], f["variant"]) == name]
        key = name[0] if name[1] is None else f"{name[0]}:{name[1]}"
        summary[key] = {"name": name[0], "variant": name[1], "seconds": max(f["seconds"] for f in same),
                        "median": statistics.median(f["seconds"] for f in same), "workers": len(same),
                        "platform": same[0]["platform"], "what": same[0]["what"]}
    data = {"format": FORMAT, "tpu": target.tpu, "zone": target.zone, "accelerator": accelerator,
            "platform": platform_of(outcome), "started": started, "ended": time.time(), "command": command,
            "ok": outcome.ok, "gcloud_exit": outcome.code, "workers": outcome.workers, "checks": checks,
            "figures": figures, "summary": summary}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    tmp.replace(path)


def programme_variants(state_dir: Path) -> list[list[str]]:
    """Each variant's trainer overrides of a programme (its programme.json, as the controller reads it)."""
    from experiments.launcher.ledger import RecordError
    from experiments.launcher.queue_state import submission_of

    path = Path(state_dir) / "programme.json"
    try:
        sub = submission_of(json.loads(path.read_text()), path, None)
    except (OSError, ValueError, RecordError) as e:
        raise PodError(f"--programme {state_dir}: cannot read its programme.json ({e}); give a programme's state "
                       "directory (outputs/programmes/<name>)") from None
    return [sub.overrides_of(v) for v in sub.variants]


def variant_overrides(given: Sequence[str], overrides: Sequence[str], programme: Path | None) -> list[list[str]]:
    """The variants to measure: a programme's, or each +experiment=G/V given, with the common overrides."""
    if programme is not None:
        if given:
            raise PodError(f"give --programme {programme} or variants ({given[0]} ...), not both")
        return [[*v, *overrides] for v in programme_variants(programme)]
    for v in given:
        if not v.startswith("+experiment="):
            raise PodError(f"{v!r}: give variants as +experiment=GROUP/VARIANT (training overrides go after `--`)")
    return [[v, *overrides] for v in given]
