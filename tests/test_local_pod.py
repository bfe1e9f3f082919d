"""Tests for experiments/launcher/local_pod.py and `launch.py local`, with throwaway worker scripts."""

from __future__ import annotations

import io
import json
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Sequence

import pytest

from experiments.launcher.local_pod import process_env, run_local_pod, with_device_count
from helpers import LAUNCH, pid_alive, wait_for


# Shared by the JAX workers: join the pod from the launcher's environment.
# jax reads JAX_COORDINATOR_ADDRESS itself, but not the process count / id.
JAX_INIT = """
import os, sys, time
import jax
jax.distributed.initialize(num_processes=int(os.environ["JAX_NUM_PROCESSES"]),
                           process_id=int(os.environ["JAX_PROCESS_ID"]))
"""


def write_script(tmp_path: Path, name: str, body: str, *, jax: bool = False) -> str:
    path = tmp_path / name
    path.write_text((JAX_INIT if jax else "") + textwrap.dedent(body))
    return str(path)


def run(tmp_path: Path, script: str, processes: int, overrides: Sequence[str] = (), **kw) -> tuple[int, str]:
    out = io.StringIO()
    kw.setdefault("timeout", 60)
    rc = run_local_pod(processes, kw.pop("devices", 1), list(overrides), script=script,
                       stream=out, **kw)
    return rc, out.getvalue()


def lines_of(output: str, i: int) -> list[str]:
    return [line[len(f"[p{i}] "):] for line in output.splitlines() if line.startswith(f"[p{i}] ")]


# --- environment -------------------------------------------------------------------------

def test_with_device_count_replaces_and_keeps_other_flags():
    assert with_device_count("", 4) == "--xla_force_host_platform_device_count=4"
    flags = "--a=1 --xla_force_host_platform_device_count=2 --b"
    assert with_device_count(flags, 8) == "--a=1 --b --xla_force_host_platform_device_count=8"


def test_process_env():
    env = process_env(1, 2, 4, 1234, {"FOO": "bar", "XLA_FLAGS": "--x"},
                      base_env={"XLA_FLAGS": "--xla_force_host_platform_device_count=9", "KEEP": "1"})
    assert env["JAX_COORDINATOR_ADDRESS"] == "127.0.0.1:1234"
    assert (env["JAX_NUM_PROCESSES"], env["JAX_PROCESS_ID"]) == ("2", "1")
    assert env["JAX_PLATFORMS"] == "cpu" and env["PYTHONUNBUFFERED"] == "1"
    assert env["XLA_FLAGS"] == "--x --xla_force_host_platform_device_count=4"
    assert env["FOO"] == "bar" and env["KEEP"] == "1"


# --- real JAX pod --------------------------------------------------------------------------

@pytest.mark.slow
def test_two_processes_join_and_reduce(tmp_path):
    script = write_script(tmp_path, "worker.py", jax=True, body="""
    import jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    mesh = Mesh(np.array(jax.devices()), ("d",))
    # Global array 0..7, each process contributing its 4 local values.
    n = jax.local_device_count()
    local = np.arange(n, dtype=np.float32) + jax.process_index() * n
    arr = jax.make_array_from_process_local_data(NamedSharding(mesh, P("d")), local)
    total = jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, P()))(arr)
    print(f"RESULT process={jax.process_index()}/{jax.process_count()} "
          f"local={jax.local_device_count()} global={jax.device_count()} "
          f"sum={float(total.addressable_data(0))}")
    """)
    rc, out = run(tmp_path, script, 2, devices=4)
    assert rc == 0, out
    for i in range(2):
        results = [l for l in lines_of(out, i) if l.startswith("RESULT")]
        assert results == [f"RESULT process={i}/2 local=4 global=8 sum=28.0"], out


@pytest.mark.slow
def test_failure_kills_the_rest(tmp_path):
    ready = tmp_path / "p0-printed"
    script = write_script(tmp_path, "worker.py", jax=True, body=f"""
    import subprocess
    from pathlib import Path
    grandchild = subprocess.Popen(["sleep", "1000"])
    print(f"PIDS {{os.getpid()}} {{grandchild.pid}}", flush=True)
    if jax.process_index() == 0:
        Path({str(ready)!r}).touch()
    else:
        while not Path({str(ready)!r}).exists():  # fail once process 0 has said its pids
            time.sleep(0.01)
        # os._exit: a plain sys.exit would sit in jax.distributed's atexit shutdown
        # barrier (300 s by default) waiting for process 0.
        os._exit(3)
    time.sleep(1000)
    """)
    rc, out = run(tmp_path, script, 2)  # the launcher's own timeout (60 s) would give 124
    assert rc == 3, out
    assert "[launch] process 1 failed (exit code 3)" in out
    pids = [int(p) for i in range(2) for l in lines_of(out, i) if l.startswith("PIDS")
            for p in l.split()[1:]]
    assert len(pids) == 4, out
    # Orphaned grandchildren are reaped by init: give it time.
    wait_for(lambda: not any(pid_alive(p) for p in pids), timeout=30, what="every worker and grandchild gone")


# --- output, exit codes, signals (plain Python workers) ------------------------------------

def test_prefixes_and_log_files(tmp_path):
    script = write_script(tmp_path, "worker.py", """
    import os, sys
    i = os.environ["JAX_PROCESS_ID"]
    for k in range(200):
        print(f"out {i} {k} " + "x" * 200)
        print(f"err {i} {k}", file=sys.stderr)
    sys.stdout.write("no newline at the end")
    """)
    rc, out = run(tmp_path, script, 2, log_dir=tmp_path / "logs")
    assert rc == 0, out
    for line in out.splitlines():
        assert re.fullmatch(r"\[launch\] .*|\[p(\d)\] (out \1 \d+ x{200}|err \1 \d+|no newline at the end)",
                            line), line
    for i in range(2):
        ours = lines_of(out, i)
        assert [l for l in ours if l.startswith("out")] == [f"out {i} {k} " + "x" * 200 for k in range(200)]
        assert [l for l in ours if l.startswith("err")] == [f"err {i} {k}" for k in range(200)]
        log = (tmp_path / "logs" / f"process_{i}.log").read_text().splitlines()
        assert log == ours  # same lines, unprefixed


def test_overrides_reach_argv_intact_via_cli(tmp_path):
    script = write_script(tmp_path, "worker.py", """
    import json, os, sys
    print("ARGV " + json.dumps(sys.argv[1:]))
    """)
    overrides = ["run.name=\"a b 'c'\"", "x=1", "--flag-like", "spaces  twice", ""]
    proc = subprocess.run(
        [sys.executable, str(LAUNCH), "local", "--processes", "2", "--script", script, "--", *overrides],
        capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for i in range(2):
        argvs = [json.loads(l[5:]) for l in lines_of(proc.stdout, i) if l.startswith("ARGV ")]
        assert argvs == [overrides], proc.stdout


def test_exit_codes(tmp_path):
    script = write_script(tmp_path, "worker.py", """
    import os, signal, sys, time
    if os.environ["JAX_PROCESS_ID"] == "1":
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(1000)
    """)
    rc, out = run(tmp_path, script, 2)
    assert rc == 128 + signal.SIGKILL
    assert "[launch] process 1 failed (killed by SIGKILL)" in out

    # Each worker writes its pid, then sleeps 1000 s: the timeout must end them, not wait for them.
    hang = write_script(tmp_path, "hang.py", f"""
    import os, pathlib, time
    pathlib.Path({str(tmp_path)!r}, "pid" + os.environ["JAX_PROCESS_ID"]).write_text(str(os.getpid()))
    time.sleep(1000)
    """)
    rc, out = run(tmp_path, hang, 2, timeout=1)
    assert rc == 124 and "[launch] timeout after 1 s; killed all processes" in out, out
    # The event: both workers are gone when the launcher returns, not left to sleep (no clock read).
    assert not any(pid_alive(int((tmp_path / f"pid{i}").read_text())) for i in range(2)), out


def _launch_and_signal(tmp_path: Path, body: str, *extra: str) -> subprocess.CompletedProcess:
    script = write_script(tmp_path, "worker.py", body)
    proc = subprocess.Popen(
        [sys.executable, str(LAUNCH), "local", "-n", "2", "--script", script, *extra],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen = []
    while sum("READY" in l for l in seen) < 2:  # both workers have installed their handlers
        line = proc.stdout.readline()
        assert line, "".join(seen)
        seen.append(line)
    proc.send_signal(signal.SIGTERM)
    out = "".join(seen) + proc.stdout.read()  # EOF when the launcher exits
    proc.wait(timeout=30)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out)


def test_sigterm_is_forwarded(tmp_path):
    # Workers "save a checkpoint" on SIGTERM and exit cleanly.
    done = _launch_and_signal(tmp_path, """
    import os, signal, sys, time
    def on_term(*_):
        print("checkpoint saved", flush=True)
        sys.exit(0)
    signal.signal(signal.SIGTERM, on_term)
    print("READY", flush=True)
    time.sleep(1000)
    """)
    assert done.returncode == 128 + signal.SIGTERM, done.stdout
    # The event: both workers ran their handler (unforwarded, they would be SIGKILLed after the
    # grace period without printing it), and nobody had to be killed.
    assert done.stdout.count("checkpoint saved") == 2, done.stdout
    assert "killing the remaining processes" not in done.stdout, done.stdout


def test_sigterm_then_sigkill_after_grace(tmp_path):
    # Like a JAX process whose preemption handler swallows SIGTERM.
    done = _launch_and_signal(tmp_path, """
    import signal, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    print("READY", flush=True)
    time.sleep(1000)
    """, "--grace-period", "1")
    assert done.returncode == 128 + signal.SIGTERM, done.stdout
    # The event: the launcher announced the 1 s grace it was given (not the default 60 s), then killed.
    assert "SIGKILL in 1 s" in done.stdout and "killing the remaining processes" in done.stdout, done.stdout


@pytest.mark.slow
def test_a_pods_console_is_human_lines_with_the_loss(sudoku_dir, tmp_path):
    """What a person sees of a 2-process pod off a terminal (the demo's command, in small): a line
    per logged step with its loss, and no event JSON or Gloo chatter (those stay in the logs)."""
    from helpers import base_overrides

    out = io.StringIO()
    rc = run_local_pod(2, 2, base_overrides(sudoku_dir, tmp_path, steps=4), stream=out, timeout=240,
                       log_dir=tmp_path / "logs")
    console = out.getvalue()
    assert rc == 0, console[-3000:]
    rows = [line for line in lines_of(console, 0) if re.match(r"step \d+/4  loss \d", line)]
    assert len(rows) == 4 and rows[-1].startswith("step 4/4  loss "), console[-3000:]
    assert all(len(line) < 100 for line in rows), rows
    assert "podrunner-" not in console and "[Gloo]" not in console, console[-3000:]
    assert "[Gloo]" in (tmp_path / "logs" / "process_0.log").read_text()  # kept where an operator looks
