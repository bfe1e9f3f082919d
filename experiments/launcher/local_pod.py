"""Run an N-process JAX "pod" on this machine, for testing multi-host code on CPU.

Each process gets the coordinator's environment that `pretrain_jax.py` reads (JAX_COORDINATOR_ADDRESS,
JAX_NUM_PROCESSES, JAX_PROCESS_ID) and M fake CPU devices; secrets only through the environment.

Exit codes of `run_local_pod` (shell conventions):
  0          every process exited 0; 8: every one 0 or 8 (preempted, checkpoint saved).
  c > 0      the first process seen failing exited with c; the others were SIGKILLed.
  128 + s    the first process seen failing was killed by signal s, or the launcher got
             signal s (130 SIGINT, 143 SIGTERM) and shut the pod down.
  124        the overall timeout expired (as coreutils `timeout`).

Why SIGKILL: once `jax.distributed` is up, JAX's preemption handler swallows SIGTERM. Each child
runs in its own session, and its whole group is killed, so grandchildren die too.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import IO, Iterator, Sequence, TextIO

from runtime import wire
from runtime.errors import EXIT_PREEMPTED, EXIT_SIGNAL_BASE, EXIT_TIMEOUT

POLL_S = 0.05  # how often the supervisor loop looks at the children
READER_JOIN_S = 5.0  # bound on waiting for output pumps after the children are gone

_DEVICE_COUNT_FLAG = re.compile(r"--xla_force_host_platform_device_count(=\S*)?(?=\s|$)")


def find_free_port(host: str = "127.0.0.1") -> int:
    """A port p with p and p + 1 free a moment ago: the coordinator's and the start-up barrier's
    (distributed.liveness_port defaults to the coordinator's + 1); they are bound shortly after."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s, socket.socket(socket.AF_INET, socket.SOCK_STREAM) as t:
            s.bind((host, 0))
            port = s.getsockname()[1]
            try:
                t.bind((host, port + 1))
            except OSError:
                continue
            return port


def with_device_count(xla_flags: str, count: int) -> str:
    """XLA_FLAGS with the host device count set to `count`, other flags kept."""
    rest = _DEVICE_COUNT_FLAG.sub("", xla_flags).split()
    return " ".join([*rest, f"--xla_force_host_platform_device_count={count}"])


def process_env(process_id: int, processes: int, devices_per_process: int, port: int,
                extra_env: dict[str, str] | None = None, base_env: dict[str, str] | None = None) -> dict[str, str]:
    """Environment of pod process `process_id`: `extra_env` last, except that the device count in
    XLA_FLAGS always follows `devices_per_process`."""
    env = dict(os.environ if base_env is None else base_env)
    env.update(
        JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
        JAX_NUM_PROCESSES=str(processes),
        JAX_PROCESS_ID=str(process_id),
        JAX_PLATFORMS="cpu",
        PYTHONUNBUFFERED="1",  # so lines reach us as they are printed
    )
    env.update(extra_env or {})
    env["XLA_FLAGS"] = with_device_count(env.get("XLA_FLAGS", ""), devices_per_process)
    return env


def describe(returncode: int) -> str:
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"killed by {name}"
    return f"exit code {returncode}"


class _Sink:
    """Line-atomic writer shared by the output pumps (the lock keeps lines whole)."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        self._lock = threading.Lock()

    def write_line(self, line: str) -> None:
        with self._lock, suppress(OSError, ValueError):  # our stdout is gone (`| head`): keep draining the pipe
            print(line, end="", file=self._stream, flush=True)


def _pump(i: int, pipe: IO[bytes], sink: _Sink, log_path: Path | None) -> None:
    """Copy one child's merged stdout/stderr to the sink, prefixed, and to its log file."""
    with open(log_path or os.devnull, "w", encoding="utf-8") as log:
        try:
            for raw in iter(pipe.readline, b""):
                line = raw.decode("utf-8", errors="replace")
                if not line.endswith("\n"):
                    line += "\n"  # last line without newline: keep the next prefix on its own line
                if wire.for_people(line):  # library chatter stays in the process's log (--log-dir)
                    sink.write_line(f"[p{i}] {line}")
                log.write(line)
                log.flush()
        finally:
            pipe.close()


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    """`sig` to the child's process group (pgid == pid: start_new_session), unless the whole group is gone."""
    with suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


@contextmanager
def _catch_signals(interrupts: list[int]) -> Iterator[None]:
    """SIGINT/SIGTERM received by the launcher, appended to `interrupts` for the loop to act on."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers can only be installed from the main thread
        return
    previous = {s: signal.signal(s, lambda signum, _: interrupts.append(signum))
                for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


class _Pod:
    def __init__(self, sink: _Sink) -> None:
        self.procs: list[subprocess.Popen] = []
        self.pumps: list[threading.Thread] = []
        self.sink = sink

    def say(self, msg: str) -> None:
        self.sink.write_line(f"[launch] {msg}\n")

    def alive(self) -> list[subprocess.Popen]:
        return [p for p in self.procs if p.poll() is None]

    def kill_all(self) -> None:
        """SIGKILL every group, then wait for the output pumps (so what is said next comes after the output)."""
        # Also groups whose leader already exited: grandchildren may still be there.
        for p in self.procs:
            _signal_group(p, signal.SIGKILL)
        for p in self.procs:
            p.wait()
        deadline = time.monotonic() + READER_JOIN_S
        for t in self.pumps:
            t.join(max(0.0, deadline - time.monotonic()))

    def shut_down(self, interrupts: list[int], grace_period: float) -> None:
        """SIGTERM everyone (to checkpoint), SIGKILL after the grace period or on a second interrupt."""
        first = len(interrupts)
        self.say(f"got {signal.Signals(interrupts[0]).name}: sending SIGTERM to all "
                 f"processes, SIGKILL in {grace_period:g} s (interrupt again to kill now)")
        for p in self.alive():
            _signal_group(p, signal.SIGTERM)
        deadline = time.monotonic() + grace_period
        while self.alive() and time.monotonic() < deadline and len(interrupts) == first:
            time.sleep(POLL_S)
        if self.alive():
            self.say("killing the remaining processes")
        self.kill_all()


def run_local_pod(processes: int, devices_per_process: int, overrides: Sequence[str], *,
                  script: str = "pretrain_jax.py", port: int | None = None, log_dir: Path | None = None,
                  extra_env: dict[str, str] | None = None, python: str = sys.executable,
                  timeout: float | None = None, grace_period: float = 60.0, stream: TextIO | None = None) -> int:
    """Run `python <script> <overrides...>` as an N-process local pod (exit codes: the module
    docstring). Output goes to `stream`, each line prefixed `[p{i}] `; the launcher's `[launch] `."""
    if processes < 1 or devices_per_process < 1:
        raise ValueError("processes and devices_per_process must be >= 1")
    port = port or find_free_port()
    sink = _Sink(stream or sys.stdout)
    if log_dir is not None:
        log_dir.mkdir(parents=True, exist_ok=True)
    cmd = [python, script, *overrides]

    interrupts: list[int] = []
    pod = _Pod(sink)
    with _catch_signals(interrupts):
        try:
            pod.say(f"{processes} processes x {devices_per_process} devices, "
                    f"coordinator 127.0.0.1:{port}: {subprocess.list2cmdline(cmd)}")
            for i in range(processes):
                env = process_env(i, processes, devices_per_process, port, extra_env)
                proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, start_new_session=True)
                pod.procs.append(proc)
                log_path = log_dir / f"process_{i}.log" if log_dir is not None else None
                pump = threading.Thread(target=_pump, args=(i, proc.stdout, sink, log_path),
                                        name=f"pump-p{i}", daemon=True)
                pump.start()
                pod.pumps.append(pump)
            return _supervise(pod, interrupts, timeout, grace_period)
        finally:
            pod.kill_all()  # no-op for a clean exit, except for stray grandchildren


def _supervise(pod: _Pod, interrupts: list[int], timeout: float | None, grace_period: float) -> int:
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        if interrupts:
            pod.shut_down(interrupts, grace_period)
            codes = ", ".join(f"p{i}: {describe(p.returncode)}" for i, p in enumerate(pod.procs))
            pod.say(f"interrupted ({codes})")
            return EXIT_SIGNAL_BASE + interrupts[0]
        codes = [p.poll() for p in pod.procs]
        failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0, EXIT_PREEMPTED)]
        if failed:
            i, code = failed[0]
            pod.kill_all()  # and its output is out before the message below
            pod.say(f"process {i} failed ({describe(code)}); killed the others")
            return EXIT_SIGNAL_BASE - code if code < 0 else code  # as a shell says it: a signal s is 128 + s
        if all(c in (0, EXIT_PREEMPTED) for c in codes):
            return EXIT_PREEMPTED if EXIT_PREEMPTED in codes else 0
        if deadline is not None and time.monotonic() > deadline:
            pod.kill_all()
            pod.say(f"timeout after {timeout:g} s; killed all processes")
            return EXIT_TIMEOUT
        time.sleep(POLL_S)
