"""What the tests share, in one place: running the trainer (in this process, as a subprocess, as a
local pod), waiting for a run to reach a step, the one-`error:`-line checks, free ports, the
fake TPU workers, and the small recursive model the tests train.

Standard library only at import time: conftest.py imports this before JAX is configured."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import http.server
import io
import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Mapping, Sequence
from unittest import mock

from experiments.launcher.local_pod import find_free_port
from runtime.cpu_backend import YNN_DOTS_ONLY  # standard library only

REPO = Path(__file__).resolve().parents[1]
PRETRAIN = REPO / "pretrain_jax.py"
LAUNCH = REPO / "experiments" / "launch.py"

# The tests' models are tiny: compiling dominates, and LLVM's -O0 compiles CPU code about twice as
# fast (same HLO passes and float semantics; only the generated machine code is less optimised).
# XLA's older CPU fusion emitters compile a train step 2.5x faster again (TRM 1.87 -> 0.71 s,
# Gemma 1.63 -> 0.57 s; losses equal to 1e-7), and the whole suite in 20% less CPU time.
# The YNNPACK flag is the one pretrain_jax.py adds on CPU (runtime/cpu_backend.py): with it in both,
# in-process runs and child processes keep sharing the compilation cache (its key hashes XLA_FLAGS).
CPU_XLA_FLAGS = f"--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false {YNN_DOTS_ONLY}"
SUITE_DEVICES = 8  # the suite's own process: a data-parallel mesh of 8 CPU devices (a devices(n) mark asks for others)

# A free port p with p + 1 free too (a pod's coordinator and its start-up barrier).
free_port = find_free_port


# ------------------------------------------------------------------------------ processes


def child_env(devices: int = 1, *, optimized: bool = False, **extra: str) -> dict[str, str]:
    """The environment of a child process on `devices` CPU devices (1 unless a test asks for a mesh:
    a trainer started as a process is there for its command line, a signal or a kill). `optimized`:
    XLA's default optimisation instead of -O0, for children whose running time is in executing
    larger steps rather than compiling tiny ones (3x faster for the programme's smoke runs)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "JAX_COORDINATOR", "JAX_NUM_PROC", "JAX_PROCESS_ID"))}
    flags = YNN_DOTS_ONLY if optimized else CPU_XLA_FLAGS
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={devices} {flags}",
               GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT="false", PYTHONUNBUFFERED="1", WANDB_SILENT="true")
    env.update(extra)
    return env


def run_pretrain(overrides: Sequence[str], *, devices: int = 1, timeout: float = 300, env: dict | None = None,
                 check: bool = True, optimized: bool = False) -> subprocess.CompletedProcess:
    """`pretrain_jax.py <overrides>` to its end, its output captured."""
    proc = subprocess.run([sys.executable, str(PRETRAIN), *overrides], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout, env=env or child_env(devices, optimized=optimized))
    if check and proc.returncode != 0:
        raise AssertionError(f"pretrain_jax.py exited {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-6000:]}")
    return proc


def launch_in_process(argv: Sequence[str], *, env: Mapping[str, str] | None = None,
                      cwd: os.PathLike | None = None) -> subprocess.CompletedProcess:
    """`launch.py argv` run in this process, its output captured; with `env` and `cwd`, as a child
    started with them would run it. For the verbs that start no controller (no signals, threads or
    children of their own), whose subprocess would spend its time importing the launcher again."""
    from experiments import launch  # heavy: JAX and Hydra, which this module leaves to its callers

    out, err, here = io.StringIO(), io.StringIO(), os.getcwd()
    environ = mock.patch.dict(os.environ, env or {}, clear=env is not None)  # restored on the way out
    try:
        if cwd is not None:
            os.chdir(cwd)
        with environ, contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = launch.main(list(argv))
            except SystemExit as e:  # argparse's own exits
                code = e.code if isinstance(e.code, int) else int(e.code is not None)
    finally:
        os.chdir(here)
    return subprocess.CompletedProcess(list(argv), code, out.getvalue(), err.getvalue())


def launch_pretrain(overrides: Sequence[str], *, devices: int = 1, env: dict | None = None,
                    merge_stderr: bool = True) -> subprocess.Popen:
    """`pretrain_jax.py <overrides>` started, not waited for (stdout piped, stderr into it)."""
    return subprocess.Popen([sys.executable, str(PRETRAIN), *overrides], cwd=REPO, env=env or child_env(devices),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT if merge_stderr else subprocess.PIPE,
                            text=True)


def start_pod(n: int, devices: int, overrides: Sequence[str], ids: Iterable[int] | None = None,
              env: dict | None = None) -> list[subprocess.Popen]:
    """A local pod of `n` pretrain_jax.py processes with `devices` CPU devices each, joined through
    a coordinator on loopback; `ids`: start only these processes (the others never join)."""
    port = free_port()
    base = env or child_env(devices)
    return [launch_pretrain(overrides, env=dict(base, JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
                                                JAX_NUM_PROCESSES=str(n), JAX_PROCESS_ID=str(i)))
            for i in (range(n) if ids is None else ids)]


def finish(procs: Sequence[subprocess.Popen], timeout: float) -> list[tuple[int, str, float]]:
    """(exit code, output, seconds from the call) of each process; one still running after
    `timeout` seconds in all is killed (SIGKILL: jax.distributed swallows SIGTERM)."""
    start, results = time.monotonic(), []
    for p in procs:
        try:
            out = p.communicate(timeout=max(1.0, timeout - (time.monotonic() - start)))[0]
        except subprocess.TimeoutExpired:
            p.kill()
            out = p.communicate()[0]
        results.append((p.returncode, out, time.monotonic() - start))
    return results


def kill(procs: Iterable[subprocess.Popen]) -> str:
    """SIGKILL whatever still runs, by its own pid; the tail of what each printed."""
    tails = []
    for p in procs:
        if p.poll() is None:
            p.kill()
        out = p.communicate()[0] if p.stdout and not p.stdout.closed else ""
        tails.append((out or "")[-2000:])
    return "\n".join(tails)


def pid_alive(pid: int) -> bool:
    """Whether `pid` exists and is neither a zombie nor dead (an orphan may wait for its reaper)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in "ZX"
    except (FileNotFoundError, IndexError):
        return False


def wait_for(condition: Callable[[], object], *, timeout: float, what: str,
              procs: Sequence[subprocess.Popen] = (), every: float = 0.05) -> object:
    """Poll `condition` until it is true (and return its value). Fails, killing `procs`, when one
    of `procs` ends first or after `timeout` seconds (a deadline for a test that went wrong, never
    a bound on how fast the code must be)."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        ended = [p for p in procs if p.poll() is not None]
        if ended or time.monotonic() > deadline:
            why = f"process {ended[0].pid} exited {ended[0].returncode}" if ended else f"not within {timeout:g} s"
            raise AssertionError(f"waiting for {what}: {why}\n{kill(procs)}")
        time.sleep(every)


def reached(metrics: os.PathLike, step: int) -> bool:
    """Whether a run's metrics.jsonl holds a row of `step` or later."""
    return os.path.exists(metrics) and any(r.get("step", 0) >= step for r in read_jsonl(metrics))


def wait_for_step(metrics: os.PathLike, step: int, procs: Sequence[subprocess.Popen] = (), timeout: float = 240) -> None:
    wait_for(lambda: reached(metrics, step), timeout=timeout, what=f"step {step} in {metrics}", procs=procs)


def kill_after_step(proc: subprocess.Popen, metrics: os.PathLike, step: int, timeout: float = 240) -> None:
    """SIGKILL the run (by pid) as soon as its metrics file shows `step`."""
    wait_for_step(metrics, step, [proc], timeout)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()


# -------------------------------------------------------------------------- the trainer


@dataclass
class Trained:
    code: int  # the exit code pretrain_jax.py would give
    log: str  # the run's log lines (the `runtime` loggers), one per line
    error: str | None = None  # a UserError's one-line message (pretrain_jax.py prints it as "error: ...")


def compose_config(overrides: Sequence[str]):
    """The validated Config that `pretrain_jax.py <overrides>` would run."""
    from runtime.hydra_compose import composed

    return composed(overrides)


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def train(overrides: Sequence[str], *, check: bool = True) -> Trained:
    """Run the trainer in this process (one process, the session's 8 CPU devices), as
    `pretrain_jax.py <overrides>` would: a UserError becomes its exit code and one-line message.
    The root logger and the SIGTERM handler are restored afterwards."""
    from runtime.errors import UserError
    from runtime.trainer import run

    root, handler = logging.getLogger(), _Lines()
    handlers, level, on_sigterm = root.handlers[:], root.level, signal.getsignal(signal.SIGTERM)
    logging.getLogger("runtime").addHandler(handler)
    try:
        result = Trained(run(compose_config(overrides)), "")
    except UserError as e:
        result = Trained(e.exit_code, "", str(e))
    finally:
        logging.getLogger("runtime").removeHandler(handler)
        root.handlers[:] = handlers  # setup_logging's basicConfig(force=True) replaced them
        root.setLevel(level)
        signal.signal(signal.SIGTERM, on_sigterm)  # PreemptionWatcher.close() leaves SIG_DFL
    result.log = "\n".join(handler.lines)
    if check and result.code != 0:
        raise AssertionError(f"training exited {result.code}: {result.error}\n--- log\n{result.log[-6000:]}")
    return result


def read_jsonl(path: os.PathLike) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def use_cpu_devices(n: int) -> None:
    """Give this process n CPU devices from now on: JAX's backends are dropped and made again (the
    arrays and compiled programs of the old ones go with them; the persistent cache stays)."""
    import jax
    from jax.extend import backend

    if jax.device_count() != n:
        backend.clear_backends()
        jax.config.update("jax_num_cpu_devices", n)


def train_losses(output_dir: os.PathLike) -> dict[int, float]:
    """step -> train/loss from a run's metrics.jsonl (log_every=1 gives every step)."""
    return {r["step"]: r["train/loss"] for r in read_jsonl(Path(output_dir) / "metrics.jsonl") if "train/loss" in r}


def logged_metrics(output_dir: os.PathLike) -> dict[int, dict[str, float]]:
    """step -> every train/ and eval/ metric a run logged at that step (rows of a step merged; a
    step logged again after a resume: its last row). Left out: wall-clock (`time`, perf/*) and
    what each launch logs of the model where it starts (model/*)."""
    out: dict[int, dict[str, float]] = {}
    for row in read_jsonl(Path(output_dir) / "metrics.jsonl"):
        kept = {k: v for k, v in row.items() if k.startswith(("train/", "eval/"))}
        if kept:
            out.setdefault(row["step"], {}).update(kept)
    return out


def saved_steps(checkpoint_dir: os.PathLike) -> list[int]:
    """The step folders in a local checkpoint directory, in order."""
    return sorted(int(p.name) for p in Path(checkpoint_dir).iterdir() if p.name.isdigit())


def resumed_step(log: str) -> int:
    """The step a run's log says it resumed from."""
    return int(log.split("resumed from step ")[1].split()[0])


def base_overrides(data: Path, root: Path, *, steps: int = 8, name: str = "t", wandb: str = "disabled") -> list[str]:
    """A fast run: tiny model, batch 16, every step logged, checkpoints at half-way and end,
    W&B off (tests of W&B output pass wandb="offline")."""
    return [f"data.path={data}", "data.generate_if_missing=false", f"run.root={root}", "run.progress_bar=false",
            "run.group=test", f"run.name={name}", f"train.steps={steps}", "train.log_every=1",
            f"train.checkpoint_every={steps // 2}", f"train.eval_every={steps}", "train.global_batch_size=16",
            "arch.hidden=32", "arch.heads=2", "optim.warmup_steps=2", f"run.wandb.mode={wandb}"]


# A tiny TRM-MLP run with the reference optimizers (AdamATan2 + sign-SGD table + EMA) and a
# constant LR after warmup (a run stopped and extended follows one schedule). halt_max_steps=3
# with checkpoints every 2 or 4 steps: a resume lands mid-ACT (rows with steps > 0 in the carry).
TRM = ["arch=trm_mlp", "optim=adam_atan2", "arch.hidden=64", "arch.heads=2", "arch.L_layers=1", "arch.H_cycles=2",
       "arch.L_cycles=2", "arch.halt_max_steps=3", "arch.puzzle_emb_len=1", "arch.forward_dtype=float32", "optim.lr=5e-3",
       "optim.puzzle_emb_lr=1e-2", "optim.weight_decay=0.1", "optim.ema_rate=0.9", "optim.lr_min_ratio=1.0"]


def trm_overrides(data: Path, root: Path, steps: int, **options) -> list[str]:
    base = [o for o in base_overrides(data, root, steps=steps, **options) if not o.startswith(("arch.hidden=", "arch.heads="))]
    return base + TRM


# The shared reference: REFERENCE_STEPS steps of base_overrides + REFERENCE_EXTRA, uninterrupted.
# Tests that stop and resume a run with these settings (and any checkpoint/mesh settings, which do
# not change the losses) compare against its losses (conftest's reference_losses) instead of
# training their own.
REFERENCE_STEPS, REFERENCE_EXTRA = 30, ["optim.ema_rate=0.9"]


# ----------------------------------------------------------------- the small recursive model

# The TRM the tests build directly (models/recursive_reasoning/trm.py's TRMConfig fields); a test
# that needs another size or switch says so at the call: small_trm(H_cycles=3).
SMALL_TRM = dict(hidden=32, heads=4, L_layers=1, H_cycles=2, L_cycles=2, puzzle_emb_ndim=32, puzzle_emb_len=2,
                 forward_dtype="float32", halt_max_steps=4, halt_exploration_prob=0.0, mlp_t=False,
                 pos_encodings="rope")


def small_trm(**changes):
    from models.recursive_reasoning.trm import TRMConfig

    return TRMConfig(**(SMALL_TRM | changes))


# The same model as trainer overrides (the Sudoku MLP-t form the programme's baseline uses).
TRM_OVERRIDES = ["arch=trm_mlp", "arch.hidden=32", "arch.heads=2", "arch.L_layers=1", "arch.H_cycles=2",
                 "arch.L_cycles=2", "arch.puzzle_emb_ndim=32", "arch.forward_dtype=float32"]


# ------------------------------------------------------------------ one `error:` line


def error_line(text: str, *needles: str, last: bool = False) -> str:
    """The one line of `text` that starts with `error:` (there must be exactly one), holding every
    needle; no traceback or crash dump anywhere. `last`: nothing is said after it."""
    errors = [line for line in text.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, f"{len(errors)} error: lines\n{text[-3000:]}"
    for bad in ("Traceback", "Check failure", "Fatal Python error"):
        assert bad not in text, text[-3000:]
    if last:
        assert text.rstrip().splitlines()[-1] == errors[0], f"said more after the error line\n{text[-3000:]}"
    for needle in needles:
        assert needle in errors[0], (needle, errors[0])
    return errors[0]


def assert_exit_one_line(proc: subprocess.CompletedProcess, code: int, *needles: str) -> str:
    """A command that exited `code` with one `error:` line on stderr, its last line, before any
    train step compiled."""
    assert proc.returncode == code, (proc.returncode, proc.stdout[-2000:], proc.stderr[-3000:])
    line = error_line(proc.stderr, *needles, last=True)
    assert "compiled train step" not in proc.stderr + proc.stdout
    return line


def assert_user_error(result: Trained, *needles: str) -> str:
    """An in-process run refused with exit 2 before compiling, its message one line with `needles`."""
    assert result.code == 2 and result.error, (result.code, result.log[-3000:])
    assert "\n" not in result.error and "compiled train step" not in result.log, result.error
    for needle in needles:
        assert needle in result.error, (needle, result.error)
    return result.error


def one_line(error: BaseException, *needles: str, code: int | None = None) -> str:
    """The message of an error the code raised for the user: one line, with `needles` (and
    `code`: the exit code it carries)."""
    message = str(error)
    assert message and "\n" not in message, message
    if code is not None:
        assert getattr(error, "exit_code", None) == code, (getattr(error, "exit_code", None), message)
    for needle in needles:
        assert needle in message, (needle, message)
    return message


def cli_refused(capsys, main: Callable[[list[str]], object], argv: list[str], code: int, *needles: str) -> str:
    """A command's `main(argv)` run in this process ends with exit `code` (returned or through
    SystemExit) and exactly one `error:` line on stderr, at the start of a line (after a progress
    bar's carriage return too) and last, holding `needles`; that line is returned."""
    try:
        got = main(argv)
    except SystemExit as e:
        got = e.code
    err = capsys.readouterr().err
    assert got == code, (got, err[-3000:])
    assert "\rerror:" not in err and (err.startswith("error:") or "\nerror:" in err), err[-3000:]
    return error_line(err.replace("\r", ""), *needles, last=True)


def tree_hash(root: os.PathLike) -> dict[str, str]:
    """sha256 of every file under `root`, by relative path; but the run's log files
    (run.log, run.process<k>.log), to which every launch appends its library logs by design."""
    root = Path(root)
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and not re.fullmatch(r"run(\.process\d+)?\.log", p.name)}


def raises_one_line(kind: type[BaseException], fn: Callable[[], object], *needles: str, code: int | None = None) -> str:
    """`fn()` raises `kind` whose message is one line with `needles` (see one_line)."""
    import pytest

    with pytest.raises(kind) as raised:
        fn()
    return one_line(raised.value, *needles, code=code)


# ------------------------------------------------------------------------ fake TPU workers


class MetadataServer:
    """A fake GCE metadata server on loopback answering `attributes` (e.g. a TPU VM worker's
    agent-worker-number); its `address` is what GCE_METADATA_IP names."""

    def __init__(self, attributes: Mapping[str, str]):
        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                key = self.path.rsplit("/", 1)[-1]
                ok = self.headers.get("Metadata-Flavor") == "Google" and key in attributes
                self.send_response(200 if ok else 404)
                self.end_headers()
                self.wfile.write(attributes.get(key, "").encode() if ok else b"")

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.address = f"127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()


def make_fake_workers(root: Path, workers: int, trainer: str | None, *, activate: str = "",
                      image: bool = False) -> list[Path]:
    """The home directory of each fake TPU worker (tests/fake_gcloud), with ~/repo holding a .venv
    whose python is this one, a setup_tpu.sh that succeeds, the worker-side code (experiments/,
    runtime/ and pyproject.toml, linked), and `trainer` as pretrain_jax.py (or, when None, the
    real repository's files, linked). `activate`: more shell for .venv/bin/activate. `image`:
    write the boot image instead (root/image), from which the fake control plane makes each
    TPU's workers when it creates the TPU (fresh disks); returns [root/image]."""
    homes = [root / "image"] if image else [root / f"worker-{i}" for i in range(workers)]
    for home in homes:
        repo = home / "repo"
        (repo / ".venv" / "bin").mkdir(parents=True)
        # Like a real activate: our python first on PATH.
        (repo / ".venv" / "bin" / "activate").write_text(f"{activate}export PATH={Path(sys.executable).parent}:$PATH\n")
        (repo / ".venv" / "bin" / "python").symlink_to(sys.executable)
        for shared in ("pyvenv.cfg", "lib"):  # this venv's packages, as a real .venv has its own
            (repo / ".venv" / shared).symlink_to(Path(sys.prefix) / shared)
        (repo / "setup_tpu.sh").write_text("echo setup_tpu.sh: ok on $(hostname)\n")
        if trainer is not None:
            (repo / "pretrain_jax.py").write_text(trainer)
            for shared in ("experiments", "runtime"):  # what runs on a worker beside the trainer
                (repo / shared).symlink_to(REPO / shared)
            (repo / "pyproject.toml").write_text((REPO / "pyproject.toml").read_text())  # a copy: tests edit it
            continue
        for entry in REPO.iterdir():
            if not entry.name.startswith(".") and entry.name not in ("setup_tpu.sh", "outputs"):
                (repo / entry.name).symlink_to(entry)
    return homes


# ------------------------------------------------------------------------------- full disks


@contextlib.contextmanager
def small_disk(path: Path, size: str):
    """A tmpfs of `size` mounted at `path`, unmounted afterwards (its contents are lost). Needs root
    or CAP_SYS_ADMIN, as CI has: without them the test fails (a missing capability is not a pass)."""
    path.mkdir(parents=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                             capture_output=True, text=True)
    if mounted.returncode:
        raise AssertionError(f"cannot mount a tmpfs to fill up (run the suite as root or with CAP_SYS_ADMIN, or "
                             f"deselect the full-disk tests): {mounted.stderr.strip()}")
    try:
        yield path
    finally:
        if subprocess.run(["umount", str(path)], capture_output=True).returncode:
            subprocess.run(["umount", "-l", str(path)], capture_output=True)  # busy: detach now, free when unused


def fill(disk: Path, leave: int) -> None:
    """Take all but `leave` bytes of `disk`'s free space, in one allocation (no moment of a full
    disk for writes that still fit)."""
    with open(disk / "filler", "wb") as f:
        for _ in range(20):
            st = os.statvfs(disk)
            try:
                os.posix_fallocate(f.fileno(), 0, max(0, st.f_bavail * st.f_frsize - leave))
                return
            except OSError as e:  # the run wrote meanwhile: measure again
                if e.errno != errno.ENOSPC:
                    raise
        raise AssertionError(f"could not fill {disk}")


# ---------------------------------------------------------------- a pod behind the fake gcloud

FAKE_GCLOUD_DIR = Path(__file__).resolve().parent / "fake_gcloud"  # `gcloud` and fake_tpu.py
POD_SECRET = "wandb-secret-7f3a9c"
POD_WORKERS = 2

# The stand-in trainer of conftest's `pod` fixture: records its argv, cwd and environment (secrets
# as hashes) in ~/stub_run.json, prints three steps, then waits for ~/go when STUB_WAIT is set.
POD_STUB = """\
import hashlib, json, os, sys, time
keys = ("PODRUNNER_RUN_ID", "TPU_WORKER_ID", "STUB_VENV", "PYTHONUNBUFFERED", "EXTRA")
secret = lambda v: v and "sha256:" + hashlib.sha256(v.encode()).hexdigest()
info = {"argv": sys.argv[1:], "pid": os.getpid(), "cwd": os.getcwd(), "env": {k: os.environ.get(k) for k in keys}}
info["env"].update({k: secret(os.environ.get(k)) for k in ("WANDB_API_KEY", "HF_TOKEN")})
home = os.environ["HOME"]
with open(os.path.join(home, "stub_run.json.tmp"), "w") as f:
    json.dump(info, f)
os.replace(os.path.join(home, "stub_run.json.tmp"), os.path.join(home, "stub_run.json"))  # whole, or not there
worker = os.environ["TPU_WORKER_ID"]
print(f"stub worker {worker} argv={json.dumps(sys.argv[1:])}", flush=True)
if os.environ.get("STUB_RUN_ID"):  # as runtime/trainer.py says it
    from runtime import events
    events.emit("started", run_id=os.environ["STUB_RUN_ID"], step=3, total=5, resumed=True)
for step in (1, 2, 3):
    print(f"step {step}", flush=True)
time.sleep(float(os.environ.get("STUB_SLEEP", "0")))
deadline = time.monotonic() + 120  # never outlive a test that failed before saying "go"
while os.environ.get("STUB_WAIT") and not os.path.exists(os.path.join(home, "go")) and time.monotonic() < deadline:
    time.sleep(0.05)  # until the test has looked at the running pod
sys.exit(3 if os.environ.get("STUB_FAIL_WORKER") == worker else 0)
"""


def target(*extra: str) -> list[str]:
    """The TPU the `pod` fixture's launches name."""
    return ["--tpu", "my-tpu", "--zone", "us-central2-b", *extra]


def fake_plane(tmp_path: Path, **extra: str) -> tuple[Path, dict[str, str]]:
    """A fake Cloud TPU control plane under tmp_path/workers (tests/fake_gcloud) with no TPU yet, and
    the environment of a command that uses it: the fake gcloud first on PATH, 2 workers a slice
    with 1 CPU device each, a created TPU READY at its second describe, the workers' TPU files
    inside their homes."""
    sys.path.insert(0, str(FAKE_GCLOUD_DIR))
    import fake_tpu

    root = tmp_path / "workers"
    root.mkdir()
    fake_tpu.enable(root)
    # One CPU device per worker: a pod step's collectives cost ~8x less than with 4 (gloo ranks).
    env = {k: v for k, v in child_env(1).items() if not k.startswith(("PODRUNNER_", "FAKE_GCLOUD_"))}
    env.update(PATH=f"{FAKE_GCLOUD_DIR}{os.pathsep}{env.get('PATH', '')}", FAKE_GCLOUD_ROOT=str(root),
               FAKE_GCLOUD_LOG=str(tmp_path / "gcloud.jsonl"), FAKE_GCLOUD_WORKERS="2",
               FAKE_GCLOUD_CREATE_POLLS="2", PODRUNNER_LIBTPU_LOCKFILE="~/libtpu_lockfile",
               PODRUNNER_TPU_DEVICES="~/fake-accel*")
    env.update(extra)
    return root, env


def gcloud_calls(log: Path) -> list[list[str]]:
    """The fake gcloud's calls (its FAKE_GCLOUD_LOG), each its argv."""
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


class FakeProgramme:
    """A programme on the fake control plane (tests/fake_gcloud): submit, run, the other commands, its
    ledger; its controllers killed and its fake workers powered off by `close`."""

    NAME, ZONE = "prog", "us-central2-b"

    def __init__(self, tmp_path: Path, **env: str) -> None:
        self.tmp = tmp_path
        self.root, self.env = fake_plane(tmp_path, **env)
        self.state_dir = tmp_path / "programmes"
        self.started: list[subprocess.Popen] = []

    def launch(self, verb: str, *args: str) -> list[str]:
        return [sys.executable, str(LAUNCH), "programme", verb, self.NAME, "--state-dir", str(self.state_dir), *args]

    def submit(self, *args: str, variants: Sequence[str] = ("exp08/ema0.99", "exp08/off"), slices: tuple[str, ...] = ("s1",),
               overrides: tuple[str, ...] = (), accelerator: str = "v4-16",
               data_on_every_slice: bool = True) -> subprocess.CompletedProcess:
        groups = sorted({v.split("/")[0] for v in variants})
        slice_args = [a for s in slices for a in ("--slice", s)]
        # --data-on-every-slice: the stubs read no data; a spot programme whose data is on the workers'
        # disks is refused at submit (tests/test_hardening_round4_programme.py), the real trainer's below
        # reads it from gs://
        return self.command("submit", *groups, "--variants", ",".join(variants), *slice_args, "--zone", self.ZONE,
                            "--accelerator-type", accelerator, "--runtime-version", "tpu-ubuntu2204-base", "--spot",
                            *(["--data-on-every-slice"] if data_on_every_slice else []),
                            "--repo-dir", "~/repo", "--poll-seconds", "0.05", "--backoff-seconds", "0.1",
                            "--stop-grace", "5", *args, "--", *overrides)

    def command(self, verb: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        """A controller (`run`, `submit --run`) in a process of its own, as users start it (its
        lease, its signals, its threads); the other verbs in this one."""
        if verb == "run" or "--run" in args:
            return subprocess.run(self.launch(verb, *args), cwd=self.tmp, env=self.env, stdin=subprocess.DEVNULL,
                                  capture_output=True, text=True, timeout=timeout)
        return launch_in_process(self.launch(verb, *args)[2:], env=self.env, cwd=self.tmp)

    def start(self, verb: str = "run", **env: str) -> subprocess.Popen:
        proc = subprocess.Popen(self.launch(verb), cwd=self.tmp, env=dict(self.env, **env), stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.started.append(proc)
        return proc

    def ledger(self) -> dict:
        return json.loads((self.state_dir / self.NAME / "ledger.json").read_text())

    def states(self) -> dict[str, str]:
        return {v: r["state"] for v, r in self.ledger()["variants"].items()}

    def close(self) -> None:
        for proc in self.started:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        import fake_tpu  # tests/fake_gcloud, on the path once fake_plane ran

        fake_tpu.power_off(list(self.root.glob("*/worker-*")))
