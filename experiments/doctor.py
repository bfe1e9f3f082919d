"""`launch.py doctor`: the first ten minutes on a slice. Every worker runs its checks and short
measurements (experiments/launcher/worker/doctor_checks.py) through the one `gcloud ... ssh
--worker=all` that `pod` uses; this side compares what the workers said (the same versions
everywhere, every worker answered), prints one verdict line per check and worker and a summary
table, writes the JSON file (`write_file`: every check, every figure, where and when, each figure
labelled with the platform it was measured on), and deletes the bucket's scratch prefix.

`plan --calibrate-from FILE` reads that file (`read_calibration`, `scale_steps`).
Exit 0 only when every check passed (or does not apply there); EXIT_CHECK_FAILED otherwise.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Mapping, Sequence, TextIO

from experiments.launcher import gcloud, pod
from experiments.launcher.gcloud import PodError, Target
from experiments.launcher.worker import SECRETS_PREFIX
from experiments.launcher.worker.doctor_checks import BUDGETS, GROUPS, Spec
from runtime import wire
from runtime.errors import EXIT_CHECK_FAILED, EXIT_INTERRUPTED, UserError

if TYPE_CHECKING:  # at run time only where the plan reads a file: it imports pydantic (every command builds the parser)
    from experiments.plan.bill import Figure
    from experiments.plan.calibrate import Calibration

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


# --- the command line ---------------------------------------------------------------------------

def main_args(args: argparse.Namespace, target: Target) -> int:
    """Before anything else on a slice: on every worker (one ssh --worker=all, as `pod`), check the
    software (the same everywhere), the TPU (its devices, no process holding it, no stale lockfile,
    HBM), the ports between workers, the metadata server, jax.distributed and an all-reduce, the
    bucket, W&B, the maintenance endpoint and the disk; measure runtime_init and, for the variants
    given, compiles, step and eval-step time, a save and a restore in short runs. One verdict line per check and
    worker, a summary table, and --out (JSON; `plan --calibrate-from` reads it). Exit 0 only when
    every check passed, 10 otherwise; what to do for each failure: docs/SETUP.md, "Your first slice"."""
    only = [g for g in (args.only or ",".join(GROUPS)).split(",") if g]
    unknown = [g for g in only if g not in GROUPS]
    if unknown:
        raise pod.PodError(f"--only {unknown[0]}: not a check; give some of {','.join(GROUPS)}")
    if args.bucket and not args.bucket.startswith("gs://"):
        raise pod.PodError(f"--bucket {args.bucket}: give a gs://BUCKET[/PREFIX] URL")
    variants = variant_overrides(args.variants, args.overrides, args.programme)
    scratch = "doctor-" + pod.new_run_id()
    spec = Spec(only=only, port=args.port, liveness_port=args.liveness_port, port_wait=args.port_wait,
                scratch=scratch, bucket=args.bucket, checkpoint_mb=args.checkpoint_mb, disk_need_gb=args.disk_need_gb,
                variants=variants, measure_steps=args.measure_steps,
                measure_budget=args.measure_budget, measure_root=args.measure_root, allreduce_mb=_sizes(args.allreduce_mb))
    _, secret = pod.remote_env({}, [], os.environ)
    if args.dry_run:
        print(shlex.join(pod.gcloud.ssh_argv(target, doctor_command(args.repo_dir, spec, None))))
        return 0
    out = args.out or Path("outputs/doctor") / f"{args.tpu}-{scratch[len('doctor-'):]}.json"
    return run_doctor(target, spec, repo_dir=args.repo_dir, out_file=out, secret_env=secret,
                      command=" ".join(["python experiments/launch.py doctor --tpu", args.tpu, "--zone", args.zone,
                                        *(["--bucket", args.bucket] if args.bucket else []),
                                        *(["--only", args.only] if args.only else []), *args.variants]))


def _sizes(text: str) -> list[float]:
    try:
        sizes = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) <= 0:
        raise pod.PodError(f"--allreduce-mb {text}: give sizes in MB above 0, e.g. 1,16,64")
    return sizes


def add_arguments(p: argparse.ArgumentParser) -> None:
    """`launch.py doctor`'s options (beside the target's: --tpu, --zone, --project, --repo-dir, --dry-run)."""
    p.add_argument("variants", nargs="*", metavar="+experiment=G/V", help="variants to measure (short runs)")
    p.add_argument("--programme", type=Path, default=None, metavar="DIR",
                   help="measure a programme's variants (its state directory)")
    p.add_argument("--bucket", default=None, metavar="gs://...", help="check it from every worker (a scratch "
                   "prefix, deleted)")
    p.add_argument("--out", type=Path, default=None, metavar="FILE",
                   help="the JSON file (default: outputs/doctor/<tpu>-<time>.json)")
    p.add_argument("--only", default=None, metavar="CHECKS", help="comma-separated checks (default: all)")
    p.add_argument("--port", type=int, default=8482, help="distributed.port (default: %(default)s)")
    p.add_argument("--liveness-port", type=int, default=None, help="distributed.liveness_port (default: port + 1)")
    p.add_argument("--port-wait", type=float, default=60.0,
                   help="seconds the workers wait for each other (late workers; default: %(default)s)")
    p.add_argument("--checkpoint-mb", type=float, default=64.0, help="the timed object's size (default: %(default)s)")
    p.add_argument("--disk-need-gb", type=float, default=10.0,
                   help="free disk a worker needs: a checkpoint and the dataset (default: %(default)s)")
    p.add_argument("--measure-steps", type=int, default=4, help="steps of each short run (default: %(default)s)")
    p.add_argument("--measure-budget", type=float, default=900.0,
                   help="seconds each variant's two short runs may take (default: %(default)s)")
    p.add_argument("--measure-root", default=None, metavar="FOLDER",
                   help="the short runs' run.root, one folder every worker sees (default: <bucket>/<scratch>/runs)")
    p.add_argument("--allreduce-mb", default="1,16,64", metavar="SIZES",
                   help="the timed all-reduces' sizes per device, MB (default: %(default)s)")


# --- what the plan takes from the file -------------------------------------------------------------

def read_calibration(path: Path, figures: Mapping[str, Figure] | None = None, *, allow_platform_mismatch: bool = False
                     ) -> Calibration:
    """The figures `launch.py doctor` measured (its `summary`: each the slowest worker's, as a pod
    waits for its last) instead of the defaults, its measured step and eval-step times, and each measured
    variant's cold compile as its program start-up. A file measured on
    other devices than a TPU is refused unless `allow_platform_mismatch`: UserError, one line."""
    from experiments.plan.bill import FIGURES
    from experiments.plan.calibrate import Calibration

    figures = FIGURES if figures is None else figures
    try:
        data = json.loads(Path(path).read_text())
        summary = data["summary"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(f"--calibrate-from {path}: not a doctor file ({type(e).__name__}: {e}); give the --out "
                        "file of `launch.py doctor`, or a programme's state directory") from None
    platform = data.get("platform")
    if platform != "tpu" and not allow_platform_mismatch:
        raise UserError(f"--calibrate-from {path}: its figures were measured on {platform or 'no'} devices, not a "
                        "TPU slice's; run the doctor on the slice, or give --allow-platform-mismatch to use them")
    out, compiles = dict(figures), {}
    steps: dict[str, float] = {}
    evals: dict[str, float] = {}
    slowest: dict[str, dict] = {}
    for entry in summary.values():
        name, seconds = entry.get("name"), entry.get("seconds")
        if not isinstance(seconds, (int, float)):
            continue
        if name in ("step_time", "eval_step") and entry.get("variant") and seconds > 0:  # a ratio's numerator
            (steps if name == "step_time" else evals)[entry["variant"]] = float(seconds)
        elif name == "compile_cold" and entry.get("variant"):  # the variant's program start-up, as a ledger's
            compiles[entry["variant"]] = float(seconds)
        elif name in figures and (name not in slowest or seconds > slowest[name]["seconds"]):
            slowest[name] = entry  # measured for several variants: the slowest of them
    for name, entry in slowest.items():
        out[name] = dataclasses.replace(
            figures[name], seconds=float(entry["seconds"]), high=None,
            source=f"doctor: {entry.get('what')}, the slowest of {entry.get('workers')} workers, "
                   f"{entry.get('platform')} devices ({path})")
    return Calibration(out, compiles, steps=steps, evals=evals, accelerator=data.get("accelerator"), platform=platform)


def _topology_of(accelerator: str | None) -> str | None:
    return accelerator.replace("v5litepod-", "v5e-") if accelerator else None


def scale_steps(rows: list, calibration: Calibration, topology: str, family_of: Callable[[str], str]) -> list[str]:
    """Each measured step time (and eval-step time) against the plan's estimate for the same variant:
    their ratio scales the train (eval) estimate of every row of the same model family
    (`family_of(group)`) on this topology. A doctor file of another slice (or of CPU workers,
    allowed) is said, and scales nothing unless it came from CPU workers (their figures were
    allowed in: applied as told)."""
    lines: list[str] = []
    measured_on = _topology_of(calibration.accelerator)
    for what, attr, measured in (("step time", "estimate", calibration.steps),
                                 ("eval-step time", "eval_estimate", calibration.evals)):
        for variant, seconds in measured.items():
            row = next((r for r in rows if f"{r.group}/{r.variant}" == variant), None)
            estimate = getattr(getattr(row, attr, None), "total_s", None)
            if row is None or not estimate:
                lines.append(f"calibrated: {what} of {variant} measured {seconds:.4g} s; not in this plan (or no "
                             "estimate), nothing scaled")
                continue
            if measured_on is not None and measured_on != topology:
                lines.append(f"calibrated: {what} of {variant} measured on {measured_on}, the plan is for "
                             f"{topology}: nothing scaled")
                continue
            ratio, family = seconds / estimate, family_of(row.group)
            scaled = [r for r in rows if getattr(r, attr) is not None and family_of(r.group) == family]
            for r in scaled:
                old = getattr(r, attr)
                setattr(r, attr, dataclasses.replace(old, compute_s=None if old.compute_s is None else
                                                     old.compute_s * ratio, collective_s=old.collective_s * ratio))
            where = f"on {topology}" if measured_on else f"on {calibration.platform} workers (--allow-platform-mismatch)"
            lines.append(f"calibrated: {what} of {variant} measured {seconds:.4g} s {where} against the estimate "
                         f"{estimate:.4g} s: x{ratio:.3g} applied to the {len(scaled)} {family} variant(s) on "
                         f"{topology}")
    return lines
