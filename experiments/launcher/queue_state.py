"""The run queue's state (`launch.py programme ...`; its controller: experiments/launcher/
controller.py): what was submitted and its preflight, the programme's directory (programme.json,
ledger.json, controller.log, commands/, logs/, launch-logs/), its mirror (one state.json: the
submission and the ledger of one moment), the requests left for the controller, the controller's
lease, and repair from the mirror. docs/RUNNING.md ("State and taking over", "A damaged or
unwritable state") says what each holds and how each fault is met.

Consistency: every change to the submission and the ledger is made under `State.lock`, and a
save writes a copy taken under it (`State.save`; of two copies the higher `Ledger.seq` is the
newer), so slice threads never tear a save. Every file is read through one loader that checks it
against its typed record (ledger.RecordError) before anything is written; every write goes
through runtime/atomic.py (ledger.StateWriteError, exit 6, the file as it was).
"""

from __future__ import annotations

import contextlib
import csv
import errno
import functools
import io
import json
import math
import os
import secrets
import shlex
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TextIO

import fsspec

from experiments.launcher import pod, supervise
from experiments.launcher.gcloud import Target
from experiments.launcher.ledger import (SCHEMA, Command, Ledger, RecordError, SliceRecord, Snapshot,
                                         StateWriteError, Strict, VariantRecord, Verb, append_text, decode, dumps,
                                         load_ledger, load_snapshot, log_line, parse_json, read_state, to_text,
                                         write_text)
from experiments.programme import groups_named
from runtime import events
from runtime.errors import EXIT_STORAGE, UserError, one_line
from runtime.lease import LEASE_FILE, Lease
from runtime.ranges import Rule, at_least, name_problem, range_problem

SNAPSHOT = "state.json"  # the mirror's copy of the state: one object
COMMANDS = "commands"  # requests for the controller, in the directory and on the mirror
# --budget, `programme budget HOURS` and a budget request's value: a million pod-hours is past any
# programme, and a bound keeps the status page's picture drawable
BUDGET: Rule = (at_least(0, at_most=1_000_000), "pod-hours")
FILES = {"programme.json": "submission", "ledger.json": "ledger", "controller.log": "controller log"}
FOLDERS = {COMMANDS: "the controller's requests", "logs": "each variant's output",
           "launch-logs": "each launch's output"}


@dataclass
class Submission(Strict):
    """What `programme submit` was asked (programme.json, read strictly as the ledger's records)."""
    name: str
    variants: list[str]  # "group/variant", in the order they run
    slices: list[str]
    zone: str
    accelerator_type: str
    runtime_version: str
    project: str | None = None
    tier: str | None = None
    queued: bool = False  # create each slice through a queued resource <slice>-qr
    budget: float | None = None  # pod-hours
    planned: dict[str, dict] = field(default_factory=dict)  # variant -> {"pod_hours": h, "steps": n} (the plan's CSV)
    overrides: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    forward_env: list[str] = field(default_factory=list)
    repo_dir: str = pod.DEFAULT_REPO_DIR
    clone_url: str | None = None
    mirror: str | None = None
    max_restarts: int = 10
    poll_s: float = 30.0
    backoff_s: float = 120.0
    stop_grace_s: float = 30.0
    create_attempts: int = 3
    infra_streak: int = 3
    checkpoint_dirs: dict[str, str] = field(default_factory=dict)  # variant -> its run's checkpoint directory
    total_steps: dict[str, int] = field(default_factory=dict)  # variant -> its steps, where known before its run
    data_on_every_slice: bool = False  # the image or setup puts the inputs on every slice: spot may read disks

    def run_id(self, variant: str) -> str:
        """The variant's fixed run id (every launch resumes its checkpoint): letters, digits, . _ -."""
        raw = f"{self.name}-{variant.replace('/', '-')}"
        return "".join(c if c.isalnum() or c in "._-" else "-" for c in raw)[:64]

    @property
    def owner(self) -> str:
        """Whose its slices are (labelled at create, gcloud.OWNER_LABEL): its release deletes only those."""
        return f"programme-{self.name}"

    def overrides_of(self, variant: str) -> list[str]:
        """The trainer's overrides: the experiment, the programme's own, and its name as a W&B tag."""
        given = [o for o in self.overrides if not o.startswith("run.wandb.tags=")]
        tags = next((o.split("=", 1)[1].strip("[]") for o in self.overrides if o.startswith("run.wandb.tags=")), "")
        tags = ",".join(t for t in [*tags.split(","), self.name] if t.strip())
        return [f"+experiment={variant}", *given, f"run.wandb.tags=[{tags}]"]

    def spec(self, variant: str, slice_name: str, state_dir: Path) -> supervise.Spec:
        return supervise.Spec(
            Target(slice_name, self.zone, self.project), self.run_id(variant), self.overrides_of(variant),
            accelerator_type=self.accelerator_type, runtime_version=self.runtime_version, tier=self.tier,
            queued_resource=f"{slice_name}-qr" if self.queued else None, max_restarts=self.max_restarts,
            repo_dir=self.repo_dir, log_dir=state_dir / "launch-logs", env=dict(self.env),
            forward_env=list(self.forward_env), poll_s=self.poll_s,
            storage_backoff_s=self.backoff_s, stop_grace_s=self.stop_grace_s, clone_url=self.clone_url,
            at_end="keep", create_attempts=self.create_attempts, events_file=self.events_file(variant),
            owner=self.owner)

    def events_file(self, variant: str) -> str | None:
        """The variant's events beside its checkpoints (runtime/run_files.py), when its directory is known."""
        directory = self.checkpoint_dirs.get(variant)
        return f"{directory.rstrip('/')}/run_files/{events.FILE}" if directory else None

    def planned_hours(self, variant: str) -> float | None:
        return (self.planned.get(variant) or {}).get("pod_hours")

    def local_checkpoints(self) -> list[str]:
        """The variants whose checkpoints are not on gs:// (on the workers' disks, which a deleted slice
        takes with it), or whose checkpoint directory is not known."""
        return [v for v in self.variants if not self.checkpoint_dirs.get(v, "").startswith("gs://")]

    def release_on_stop(self) -> bool:
        """`programme stop`'s default (docs/RUNNING.md): delete the slices when every variant's
        checkpoints are on gs:// (nothing is lost with them; the next `programme run` creates them
        again), else keep them READY (deleting them would lose the checkpoints on their disks)."""
        return not self.local_checkpoints()


# --- preflight -------------------------------------------------------------------------------------

def read_plan(path: Path) -> dict[str, dict]:
    """{group/variant: {"pod_hours", "steps", "step_s"}} from a CSV of `launch.py plan`; one that cannot
    be read as such (missing, another CSV, a number that is not one) is one line (UserError)."""
    planned = {}
    try:
        with open(path, newline="") as f:
            for row in csv.DictReader(f):
                if row["variant"] == "TOTAL" or row["group"] == "ALL":
                    continue
                hours = float(row["pod_hours"]) if row["pod_hours"] else None
                if hours is not None and (not math.isfinite(hours) or range_problem(hours, BUDGET)):
                    raise ValueError(f"pod_hours {hours} of {row['group']}/{row['variant']}")
                planned[f"{row['group']}/{row['variant']}"] = {
                    "pod_hours": hours, "steps": int(row["steps"]) if row["steps"] else None,
                    "step_s": float(row["step_s"]) if row["step_s"] else None,
                    "executables": row.get("executables") or "",
                    "executables_digest": row.get("executables_digest") or ""}
    except (OSError, UnicodeDecodeError, KeyError, ValueError, TypeError, csv.Error) as e:
        detail = f"no column {e}" if isinstance(e, KeyError) else getattr(e, "strerror", None) or str(e)
        raise UserError(f"--plan {path} cannot be read as the CSV of `launch.py plan` ({detail}); give the file that "
                        "`launch.py plan GROUP ... --csv PATH` wrote") from None
    return planned


def with_executables(overrides: list[str], planned: dict[str, dict], variants: list[str]) -> list[str]:
    """The programme's overrides, with `run.executables=FOLDER run.executables_digest=sha256:...` when
    its plan kept the variants' steps compiled ahead in FOLDER (`plan --executables`), priced so, and
    the overrides do not say otherwise: the runs read what the budget assumed they would, and only
    what the plan's manifest of that digest vouches for (runtime/executables.py)."""
    kept = sorted({(p.get("executables") or "", p.get("executables_digest") or "")
                   for p in (planned.get(v) or {} for v in variants)} - {("", "")})
    if not kept or any(o.split("=", 1)[0].lstrip("+") == "run.executables" for o in overrides):
        return overrides
    if len(kept) > 1:
        raise UserError(f"--plan keeps the variants' steps compiled ahead in {len(kept)} folders or plans "
                        f"({', '.join(f for f, _ in kept)}); plan them in one (plan --executables FOLDER) or give "
                        "-- run.executables=FOLDER run.executables_digest=sha256:...")
    folder, digest = kept[0]
    if not digest:
        raise UserError(f"--plan names {folder} for the steps compiled ahead but no digest of its manifest "
                        "(a plan of an older version); plan again with --executables")
    return [*overrides, f"run.executables={folder}", f"run.executables_digest={digest}"]


def check_run_ids(sub: Submission) -> None:
    """Each variant's run id is its own (they are cut at 64 characters: a long programme name would
    give two variants one id, and one would resume the other's checkpoint)."""
    seen: dict[str, str] = {}
    for variant in sub.variants:
        other = seen.setdefault(sub.run_id(variant), variant)
        if other != variant:
            raise UserError(f"{other} and {variant} would share the run id {sub.run_id(variant)!r} (run ids are "
                            "<programme>-<group>-<variant>, cut at 64 characters): choose a shorter programme NAME")


def choose_variants(groups: list[str], only: list[str]) -> list[str]:
    """group/variant of the groups (`all`: every group) in plan order, or just `only` of them
    (each `group/variant`, or a variant name of any of the groups)."""
    from experiments.compose import variants as group_variants  # here: JAX and Hydra take seconds; only submit and run compose

    names = groups_named(groups)
    chosen = [f"{g}/{v}" for g in names for v in group_variants(g)]
    if not only:
        return chosen
    picked = [c for c in chosen if c in only or c.split("/", 1)[1] in only]
    missing = [o for o in only if not any(c == o or c.split("/", 1)[1] == o for c in picked)]
    if missing:
        raise UserError(f"no variant(s) {missing} in {names}; `launch.py list {' '.join(names)}` shows them")
    return picked


def preflight(sub: Submission) -> list[str]:
    """One line per problem of a variant: its config does not compose or validate, its dataset on
    gs:// is missing, no planned pod-hours under a budget; and the budget must cover the first.
    Fills in each variant's checkpoint directory."""
    from runtime import hydra_compose  # here: JAX and Hydra take seconds; only submit and run compose
    from runtime.config import run_dirs

    problems, on_disks = [], []
    for variant in sub.variants:
        try:  # under the workers' environment (PODRUNNER_DATA names the data), os.environ untouched
            config = hydra_compose.composed(sub.overrides_of(variant), env=sub.env)
        except Exception as e:  # noqa: BLE001 - what the trainer would say, in one line
            problems.append(f"{variant}: {' '.join(str(e).split())[:300]}")
            continue
        sub.checkpoint_dirs[variant] = run_dirs(config)[1]
        total = config.train.steps or (sub.planned.get(variant) or {}).get("steps")  # epochs: the plan's count
        if total:
            sub.total_steps[variant] = int(total)
        if str(config.data.path).startswith("gs://") and not _exists(str(config.data.path)):
            problems.append(f"{variant}: dataset {config.data.path} does not exist")
        on_disks += [(variant, key, path) for key, path in worker_inputs(config) if "://" not in path]
        if sub.budget is not None and sub.planned_hours(variant) is None:
            problems.append(f"{variant}: no planned pod-hours for the budget: give --plan with the CSV of "
                            "`launch.py plan` for these groups")
    if on_disks and sub.tier == "spot" and not sub.data_on_every_slice:
        variant, key = on_disks[0][:2]
        inputs = ", ".join(f"{k}={path}" for v, k, path in on_disks if v == variant)
        more = len({v for v, _, _ in on_disks}) - 1
        problems.append(
            f"{variant}: {inputs} {'is' if inputs.count('=') == 1 else 'are'} on the workers' disks"
            f"{f' (and {more} more variants read theirs there)' if more else ''}, and a spot slice re-created after "
            "a preemption has fresh, empty disks, so every variant run there after it would fail: put the data on "
            f"gs:// (--env PODRUNNER_DATA=gs://BUCKET/data, or -- {key}=gs://...), or give --data-on-every-slice "
            "when the boot image or the setup puts it on every slice")
    first = sub.variants[0] if sub.variants else None
    if first and sub.budget is not None and (sub.planned_hours(first) or 0.0) > sub.budget:
        problems.append(f"{first}: its planned {sub.planned_hours(first):.3f} pod-hours exceed the budget "
                        f"{sub.budget:g}: raise --budget")
    return problems


def stop_choice(sub: Submission, release: bool | None) -> tuple[bool, str]:
    """`programme stop [--release | --keep]`: whether the slices are deleted once the running variants
    have stopped (neither: the submission's default, `Submission.release_on_stop`), and the words that
    say it. --release where checkpoints are on the workers' disks is refused (UserError): deleting the
    slices would delete them."""
    local = sub.local_checkpoints()
    if release and local:
        raise UserError(f"--release would delete the slices and with them the checkpoints on their disks ({local[0]}"
                        f"{f' and {len(local) - 1} more' if len(local) > 1 else ''}: "
                        f"{sub.checkpoint_dirs.get(local[0]) or 'its directory unknown'}); stop without it (the "
                        "slices are kept READY), or put the checkpoints on gs:// (run.checkpoint.dir=gs://...)")
    release = sub.release_on_stop() if release is None else release
    if release:
        return True, f"; the slices {', '.join(sub.slices)} are deleted after it (the checkpoints are on gs://)"
    return False, (f"; the slices {', '.join(sub.slices)} are kept READY, billing {len(sub.slices)} pod-hour"
                   f"{'s' * (len(sub.slices) != 1)} an hour ({sub.accelerator_type} each) until deleted")


def worker_inputs(config) -> list[tuple[str, str]]:
    """(key, path) of every input a run reads from storage: its dataset(s), tokenizer, pretrained
    weights and imported parameters (None or empty: not read)."""
    data, found = config.data, []
    if data.name != "multitask":
        found.append(("data.path", data.path))
    found += [(f"data.tasks.{name}.path", task.path) for name, task in (data.tasks or {}).items()]
    found += [("data.tokenizer", data.tokenizer), ("train.init_params_from", config.train.init_params_from),
              ("arch.checkpoint", getattr(config.arch, "checkpoint", None))]
    return [(key, str(path)) for key, path in found if isinstance(path, str) and path]


def _exists(url: str) -> bool:
    try:
        fs, path = fsspec.core.url_to_fs(url)
        return fs.exists(path)
    except Exception:  # noqa: BLE001 - an unreachable bucket is as good as missing here
        return False


# --- state ---------------------------------------------------------------------------------------

class State:
    """The programme's directory: submission, ledger, event log, commands; mirrored after each change.

    Locks, always taken in this order: `lock` (every change to the submission and the ledger is made
    holding it), `write_lock` (one writer of the files at a time), `log_lock` (controller.log and
    the console). A save takes a copy of the ledger under `lock` and writes it outside; of two saves
    the later copy (`Ledger.seq`) is the one left on disk and on the mirror."""

    def __init__(self, directory: Path, stream: TextIO | None = None) -> None:
        self.dir = Path(directory)
        self.stream = stream or sys.stdout
        self.lock = threading.RLock()
        self.write_lock = threading.Lock()
        self.log_lock = threading.Lock()
        self.sub: Submission | None = None
        self.ledger = Ledger()
        self.written = -1  # the seq of the ledger on disk
        self.mirror_failed = self.mirror_unread = False  # said once until the mirror answers again
        self.ignored: set[str] = set()  # requests said to be unusable (each said once)

    @property
    def name(self) -> str:
        return self.dir.name

    def create(self, sub: Submission) -> None:
        """A new programme's files: the submission, its `submitted` event, the ledger (and the mirror's
        snapshot). A write that fails (StateWriteError) removes what this call wrote: nothing is left
        half-submitted, and what was there before is as it was."""
        made = [p for p in (self.dir, *(self.dir / name for name in FILES)) if not p.exists()]
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise StateWriteError(self.dir, e, "programme's folder") from None
        self.sub = sub
        self.ledger = Ledger(variants={v: VariantRecord(order=i, run_id=sub.run_id(v))
                                       for i, v in enumerate(sub.variants)},
                             slices={s: SliceRecord() for s in sub.slices})
        try:
            self.save_submission()
            self.event("submitted", variants=len(sub.variants), slices=",".join(sub.slices), state=self.dir)
            self.save()  # the ledger, then the mirror's snapshot: last, once the rest is here
        except StateWriteError:
            for path in reversed(made):
                with contextlib.suppress(OSError):
                    path.rmdir() if path == self.dir else path.unlink()
            raise

    def good_copy(self, mirror: str | None) -> str | None:
        """Where an intact copy of the state is and how to restore it (the mirror's snapshot), or None."""
        if not mirror:
            return None
        return (f"{mirror}/{SNAPSHOT} (`launch.py programme repair {self.name} --state-dir {self.dir.parent} "
                f"--mirror {mirror}`)")

    def load(self, mirror: str | None = None) -> None:
        """From the directory, or (a controller on another machine) first from the mirror. Every file is
        checked against its record before anything is written: a damaged one is one line
        (ledger.RecordError, or a UserError for the folders) naming it and the good copy (the mirror's)."""
        good_copy = self.good_copy(mirror)
        self.check_layout()
        paths = {name: self.dir / name for name in FILES}
        if mirror and not paths["programme.json"].exists() and not paths["ledger.json"].exists():
            self.fetch(mirror)
        raw: dict[str, bytes] = {}
        for name in ("programme.json", "ledger.json"):
            with contextlib.suppress(FileNotFoundError):
                raw[name] = read_state(paths[name], FILES[name], good_copy=good_copy,
                                       fresh="submit the programme again")
        if not raw:
            raise UserError(f"no programme at {self.dir}" + (f" nor at {mirror}" if mirror else "") +
                            "; submit it first (launch.py programme submit)")
        for name, other in (("programme.json", "ledger.json"), ("ledger.json", "programme.json")):
            if name not in raw:
                raise RecordError(FILES[name], paths[name], "missing", good_copy=good_copy,
                                  fresh="submit the programme again", wrong=f"is missing beside its {other}")
        sub = submission_of(parse_json(raw["programme.json"], what="submission", file=paths["programme.json"],
                                       good_copy=good_copy, fresh="submit the programme again"),
                            paths["programme.json"], good_copy)
        good_copy = good_copy or self.good_copy(sub.mirror)
        ledger = load_ledger(raw["ledger.json"], paths["ledger.json"], good_copy)
        check_fits(sub, ledger, paths["programme.json"], paths["ledger.json"], good_copy)
        self.sub, self.ledger = sub, ledger

    def check_writable(self) -> None:
        """The directory can be made and written (a read-only file system, no permission, a file on
        its path: StateWriteError before a submit's preflight; a full disk shows at the first write)."""
        here = self.dir
        while not here.exists() and here != here.parent:
            here = here.parent
        if not here.is_dir():
            raise StateWriteError(self.dir, NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR)),
                                  "programme's folder")
        read_only = os.statvfs(here).f_flag & os.ST_RDONLY
        if read_only or not os.access(here, os.W_OK):
            code = errno.EROFS if read_only else errno.EACCES
            raise StateWriteError(self.dir, OSError(code, os.strerror(code)), "programme's folder")

    def check_layout(self) -> None:
        """The directory, its files and its folders are what they should be (before anything is read
        or written): a file where a folder goes, or a folder where a file goes, is one line."""
        if self.dir.exists() and not self.dir.is_dir():
            raise UserError(f"the programme's state {self.dir} is a file, where its folder should be; move it away "
                            "(or give another --state-dir) and run the same command again")
        for name, what in FILES.items():
            path = self.dir / name
            if path.exists() and not path.is_file():  # a folder, or a pipe that reading would wait on forever
                kind = "a folder" if path.is_dir() else "no regular file"
                raise UserError(f"the {what} {path} is {kind}, where its file should be; move it away and run the "
                                "same command again")
        for name, what in FOLDERS.items():
            path = self.dir / name
            if path.exists() and not path.is_dir():
                raise UserError(f"{path} is a file, where the folder of {what} should be; move it away and run the "
                                "same command again")

    def fetch(self, mirror: str) -> None:
        """The mirror's state into the directory (read_mirror: all of it read and checked first),
        programme.json last; a write that fails removes what this call wrote."""
        made = []
        try:
            for name, text in read_mirror(mirror).items():
                if not (self.dir / name).exists():
                    made.append(self.dir / name)
                write_text(self.dir / name, text, FILES[name])
        except StateWriteError:
            for path in made:
                path.unlink(missing_ok=True)
            raise

    def save(self) -> None:
        """Write the ledger (its text taken under the lock), then the mirror's snapshot."""
        with self.lock:
            self.ledger.seq += 1
            seq, text = self.ledger.seq, to_text(self.ledger)
            snapshot = (to_text(Snapshot(schema=SCHEMA, seq=seq, submission=asdict(self.sub), ledger=self.ledger))
                        if self.sub and self.sub.mirror else None)
        with self.write_lock:
            if seq <= self.written:  # a later copy is on disk already
                return
            write_text(self.dir / "ledger.json", text, "ledger")  # StateWriteError: the ledger on disk as it was
            self.written = seq
            if snapshot is not None:
                self.push(snapshot)

    def push(self, snapshot: str) -> None:
        """The mirror's copy: the controller's log, then the snapshot (state.json, one object: the
        submission and the ledger of one moment). A failure is said once; the next save tries again."""
        mirror = self.sub.mirror
        try:
            log = self.dir / "controller.log"
            if log.exists():
                write_text(f"{mirror}/controller.log", log.read_text())
            write_text(f"{mirror}/{SNAPSHOT}", snapshot)
            self.mirror_failed = False
        except Exception as e:  # noqa: BLE001 - the local state stands
            if not self.mirror_failed:
                self.mirror_failed = True
                self.event("mirror-failed", uri=mirror, detail=shlex.quote(" ".join(str(e).split())[:200]))

    def event(self, name: str, **fields) -> None:
        line = log_line("[programme]", name, fields)
        with self.log_lock:
            append_text(self.dir / "controller.log", line + "\n", "controller log")
            self.stream.write(line + "\n")
            self.stream.flush()

    def command(self, verb: Verb, variant: str | None = None, value: float | None = None,
                mirror: str | None = None, release: bool | None = None) -> Command:
        """Leave a request for the controller, here and on the mirror (a controller on another machine
        reads it there); it applies it once, now or when it next starts."""
        command = Command(id=f"{time.time_ns()}-{secrets.token_hex(3)}", verb=verb, variant=variant, value=value,
                          release=release)
        text = to_text(command)
        write_text(self.dir / COMMANDS / f"{command.id}.json", text, "request")
        mirror = mirror or (self.sub.mirror if self.sub else None)
        if mirror:
            try:
                write_text(f"{mirror}/{COMMANDS}/{command.id}.json", text)
            except Exception as e:  # noqa: BLE001 - the local copy stands
                print(f"WARNING cannot leave the request on the mirror {mirror} ({' '.join(str(e).split())[:200]}): "
                      "only a controller on this machine sees it", file=sys.stderr, flush=True)
        return command

    def save_submission(self) -> None:
        with self.lock:
            text = dumps(asdict(self.sub))
        write_text(self.dir / "programme.json", text, "submission")

    def commands(self, mirror: bool = False) -> list[Command]:
        """The requests left since the last call (each file taken once read), in the order they were
        made: the directory's, and with `mirror` the mirror's too. A file that is no usable request is
        said once in one `command-ignored` line (its copies here and on the mirror are one request)."""
        found: dict[str, Command] = {}
        folder = self.dir / COMMANDS
        for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
            try:
                raw = path.read_bytes()
            except OSError as e:  # a folder named like a request: said once, left where it is
                self._ignore(path.stem, path, str(e.strerror or e))
                continue
            self._take_command(raw, path, found)
            try:
                path.unlink(missing_ok=True)
            except OSError as e:  # the directory turned read-only: as any state write
                raise StateWriteError(path, e, "request") from None
        if mirror and self.sub.mirror:
            try:
                fs, root = fsspec.core.url_to_fs(self.sub.mirror)
                for path in sorted(fs.glob(f"{root}/{COMMANDS}/*.json")):
                    where = f"{self.sub.mirror}/{COMMANDS}/{Path(path).name}"
                    try:
                        raw = fs.cat_file(path)
                    except OSError as e:  # a folder named like a request: said once, left where it is
                        self._ignore(Path(path).stem, where, str(e.strerror or e))
                        continue
                    self._take_command(raw, where, found)
                    fs.rm_file(path)
                self.mirror_unread = False
            except Exception as e:  # noqa: BLE001 - the mirror out of reach: the next poll tries again
                if not self.mirror_unread:
                    self.mirror_unread = True
                    self.event("mirror-commands-failed", uri=self.sub.mirror,
                               detail=shlex.quote(" ".join(str(e).split())[:200]))
        return [found[key] for key in sorted(found)]

    def _take_command(self, raw: bytes, where: object, found: dict[str, Command]) -> None:
        stem = Path(str(where)).stem
        try:
            data = json.loads(raw)
        except ValueError as e:
            return self._ignore(stem, where, f"not JSON ({e})")
        if isinstance(data, dict):  # a request left before requests had ids: its file's name
            data.setdefault("id", stem)
        key = data["id"] if isinstance(data, dict) and isinstance(data["id"], str) else stem
        try:
            command = decode(Command, data, what="request", file=where)
        except RecordError as e:
            return self._ignore(key, where, f"{e.field}: {e.problem}" if e.field else e.problem)
        problem = command_problem(command)
        if problem:
            return self._ignore(key, where, problem)
        found[command.id] = command

    def _ignore(self, key: str, where: object, reason: str) -> None:
        """A request that cannot be applied: one `command-ignored` line, once (by its id, or its file's
        name: the copy here and the one on the mirror are one request)."""
        if key in self.ignored:
            return
        self.ignored.add(key)
        self.event("command-ignored", id=shlex.quote(key), file=shlex.quote(str(where)),
                   reason=shlex.quote(" ".join(reason.split())[:300]))


def read_mirror(mirror: str) -> dict[str, str]:
    """The state files the mirror holds, checked as a local state is ({} when it holds none): from its
    snapshot (state.json), or the three files a mirror written before the snapshot holds; in the
    order they are written, programme.json last (a programme is there once it is)."""
    try:
        fs, root = fsspec.core.url_to_fs(mirror)
        if fs.exists(f"{root}/{SNAPSHOT}"):
            sub_file = ledger_file = f"{mirror}/{SNAPSHOT}"
            snapshot = load_snapshot(fs.cat_file(f"{root}/{SNAPSHOT}"), sub_file)
            sub = decode(Submission, snapshot.submission, what="programme snapshot", file=sub_file,
                         fresh="take over from the directory's own files", prefix=("submission",))
            ledger = snapshot.ledger
        elif fs.exists(f"{root}/programme.json") and fs.exists(f"{root}/ledger.json"):
            text = {name: fs.cat_file(f"{root}/{name}") for name in ("programme.json", "ledger.json")}
            sub_file, ledger_file = f"{mirror}/programme.json", f"{mirror}/ledger.json"
            sub = submission_of(parse_json(text["programme.json"], what="submission", file=sub_file), sub_file, None)
            ledger = load_ledger(text["ledger.json"], ledger_file)
        else:
            return {}
        check_fits(sub, ledger, sub_file, ledger_file, None)
        files = {"ledger.json": to_text(ledger), "programme.json": dumps(asdict(sub))}
        if fs.exists(f"{root}/controller.log"):
            files = {"controller.log": fs.cat_file(f"{root}/controller.log").decode(errors="replace"), **files}
        return files
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001 - out of reach, no credentials: said in one line
        raise UserError(f"cannot read the programme's mirror {mirror} ({one_line(e)[:200]}); check the URI and "
                        "access to it, then run the same command again") from None


def command_problem(command: Command) -> str | None:
    """What makes a request of the right types unusable, or None: a budget needs its value (pod-hours,
    as `programme budget` checks it); skip and retry need a variant."""
    if command.verb == Verb.BUDGET:
        if command.value is None:
            return "value: missing (a budget request holds the pod-hours)"
        problem = range_problem(command.value, BUDGET)
        return f"value: {command.value:g} is out of range: {problem}" if problem else None
    if command.verb in (Verb.SKIP, Verb.RETRY) and not command.variant:
        return f"variant: missing (a {command.verb} request names its variant)"
    return None


def check_fits(sub: Submission, ledger: Ledger, sub_file: object, file: object, good_copy: str | None) -> None:
    """The ledger (`file`) is the one of this submission (`sub_file`): the same variants and slices
    (each submitted once), and each slice's own variant one of them; else RecordError naming the field."""
    fault = functools.partial(RecordError, good_copy=good_copy, fresh="submit the programme again")
    names = [("name", sub.name), *(("slices", n) for n in sub.slices),
             *(("variants", part) for v in sub.variants for part in v.split("/", 1))]
    problems = [("variants", "names a variant twice", len(set(sub.variants)) < len(sub.variants)),
                ("slices", "names a slice twice", len(set(sub.slices)) < len(sub.slices)),
                ("slices", "names no slice", not sub.slices),  # then unsafe names, as `programme submit` checks
                *((f, f"{n[:60]!r} is no safe name: {name_problem(n)}", True) for f, n in names if name_problem(n))]
    for field_, problem, bad in problems:
        if bad:
            raise fault("submission", sub_file, problem, field=field_)
    for field_, held, submitted in (("variants", ledger.variants, sub.variants), ("slices", ledger.slices, sub.slices)):
        if set(held) != set(submitted):
            raise fault("ledger", file, f"{sorted(held)} where programme.json has {sorted(submitted)}", field=field_)
    for name, record in ledger.slices.items():
        if record.variant is not None and record.variant not in ledger.variants:
            raise fault("ledger", file, f"{record.variant!r} is no variant of the programme",
                        field=f'slices["{name}"].variant')


def submission_of(data: dict, file: object, good_copy: str | None) -> Submission:
    """programme.json's data as a Submission (strictly, as the ledger's records), or RecordError."""
    data = {k: v for k, v in data.items() if k != "schema"}
    return decode(Submission, data, what="submission", file=file, good_copy=good_copy,
                  fresh="submit the programme again")


# --- the lease and repair ----------------------------------------------------------------------------

def hold_lease(state: State):
    """The programme's lease (state directory and mirror): a second controller is refused in one line."""
    targets = [(str(state.dir), f"programme {state.name}", "--state-dir")]
    if state.sub and state.sub.mirror:
        targets.append((state.sub.mirror, f"programme {state.name} (mirror)", "--mirror"))

    def lost(error) -> None:  # another controller took over: this one must not launch anything more
        print(f"error: {error}", file=sys.stderr, flush=True)
        os._exit(EXIT_STORAGE)

    try:
        return Lease(targets, run=f"programme/{state.name}", on_lost=lost).acquire()
    except UserError as e:  # a LeaseHeld has no cause: raised as it is
        if isinstance(e.__cause__, OSError):  # the state directory cannot be written: as any state write
            raise StateWriteError(state.dir / LEASE_FILE, e.__cause__, "controller's lease") from None
        raise


def repair(state_dir: Path, mirror: str | None) -> str:
    """`programme repair` (docs/OPERATIONS.md, "A damaged or unwritable state"): what was in the way
    is moved into damaged-<UTC time>/, the mirror's files (read and checked whole first) are written.
    Refused in one line, nothing changed, when the state reads, the mirror holds no good copy, or a
    controller runs (the lease). Returns the line to print."""
    state = State(state_dir, io.StringIO())
    try:
        state.load()
    except UserError:
        pass  # the damage this repairs
    else:
        raise UserError(f"nothing to repair: the programme's state at {state.dir} reads (ledger save "
                        f"{state.ledger.seq}); `programme status {state.name}` shows it")
    if state.dir.exists() and not state.dir.is_dir():
        state.check_layout()  # its line: move the file away
    path = state.dir / "programme.json"
    with contextlib.suppress(OSError, UserError):  # the mirror its programme.json names, when it reads
        mirror = mirror or submission_of(parse_json(read_state(path, "submission"), what="submission", file=path),
                                         path, None).mirror
    if not mirror:
        raise UserError(f"give the mirror to restore {state.dir} from: `programme repair {state.name} --mirror URI` "
                        "(its programme.json names none, or cannot be read)")
    files = read_mirror(mirror)
    if not files:
        raise UserError(f"the mirror {mirror} holds no programme ({SNAPSHOT}) to restore {state.dir} from; restore "
                        "its files from another copy, or move the directory away and submit the programme again")
    try:
        state.dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise StateWriteError(state.dir, e, "programme's folder") from None
    lease = hold_lease(state)
    aside = state.dir / f"damaged-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}"
    moved: list[Path] = []
    try:
        in_the_way = [state.dir / name for name in ("programme.json", "ledger.json") if (state.dir / name).exists()]
        in_the_way += [state.dir / name for name in ("controller.log", *FOLDERS)
                       if (state.dir / name).exists() and (state.dir / name).is_dir() != (name in FOLDERS)]
        try:
            if in_the_way:
                aside.mkdir()
            for path in in_the_way:
                path.rename(aside / path.name)
                moved.append(path)
            for name, text in files.items():
                if not (name == "controller.log" and (state.dir / name).exists()):
                    write_text(state.dir / name, text, FILES[name])
        except (OSError, StateWriteError) as e:  # put back what was there: the directory as it was
            for name in ("programme.json", "ledger.json"):
                if state.dir / name not in moved:
                    (state.dir / name).unlink(missing_ok=True)
            for path in moved:
                (aside / path.name).rename(path)
            with contextlib.suppress(OSError):
                aside.rmdir()
            raise e if isinstance(e, StateWriteError) else StateWriteError(aside, e, "damaged files' folder") from None
    finally:
        lease.release()
    seq = json.loads(files["ledger.json"])["seq"]
    kept = f"; what was in the way is in {aside}" if moved else ""
    return (f"restored {state.dir} from the mirror {mirror} (ledger save {seq}){kept}; "
            f"`programme run {state.name}` carries on")
