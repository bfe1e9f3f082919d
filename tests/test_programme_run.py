"""`launch.py programme`: the queue of the programme's variants on fake TPU slices (tests/fake_gcloud).

Most tests run a stub trainer (PROGRAMME_STUB: the events of a run of 10 steps, a bad-input failure
for the variants in STUB_BAD, a wait for the file STUB_GATE); the end-to-end test runs the real
trainer on 2 slices of 2 workers x 4 CPU devices through preemptions and a killed controller.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import LAUNCH, error_line, fake_plane, gcloud_calls, make_fake_workers, wait_for

sys.path.insert(0, str(Path(__file__).resolve().parent / "fake_gcloud"))
import fake_tpu  # noqa: E402

NAME, ZONE = "prog", "us-central2-b"
EMA = ["exp08/ema0.99", "exp08/off"]

PROGRAMME_STUB = """\\
import os, sys, time
from runtime import events
variant = next(a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("+experiment="))
events.emit("started", run_id=os.environ["PODRUNNER_RUN_ID"], step=0, total=10, resumed=False)
if variant in os.environ.get("STUB_BAD", "").split(","):
    events.failed(2, f"{variant}: the stub's bad input")
    sys.exit(2)
gate = os.environ.get("STUB_GATE")
while gate and not os.path.exists(gate):
    time.sleep(0.05)
events.emit("checkpoint", step=10)
events.emit("completed", step=10, metrics={"eval/exact_accuracy": 0.25})
"""


class Programme:
    """A programme on the fake control plane: submit, run, the other commands, its ledger."""

    def __init__(self, tmp_path: Path, **env: str) -> None:
        self.tmp = tmp_path
        self.root, self.env = fake_plane(tmp_path, **env)
        self.state_dir = tmp_path / "programmes"
        self.started: list[subprocess.Popen] = []

    def launch(self, verb: str, *args: str) -> list[str]:
        return [sys.executable, str(LAUNCH), "programme", verb, NAME, "--state-dir", str(self.state_dir), *args]

    def submit(self, *args: str, variants: list[str] = EMA, slices: tuple[str, ...] = ("s1",),
               overrides: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
        groups = sorted({v.split("/")[0] for v in variants})
        slice_args = [a for s in slices for a in ("--slice", s)]
        return self.command("submit", *groups, "--variants", ",".join(variants), *slice_args, "--zone", ZONE,
                            "--accelerator-type", "v4-16", "--runtime-version", "tpu-ubuntu2204-base", "--spot",
                            "--repo-dir", "~/repo", "--poll-seconds", "0.05", "--backoff-seconds", "0.1",
                            "--stop-grace", "5", *args, "--", *overrides)

    def command(self, verb: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run(self.launch(verb, *args), cwd=self.tmp, env=self.env, stdin=subprocess.DEVNULL,
                              capture_output=True, text=True, timeout=timeout)

    def start(self, verb: str = "run", **env: str) -> subprocess.Popen:
        proc = subprocess.Popen(self.launch(verb), cwd=self.tmp, env=dict(self.env, **env), stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.started.append(proc)
        return proc

    def ledger(self) -> dict:
        return json.loads((self.state_dir / NAME / "ledger.json").read_text())

    def states(self) -> dict[str, str]:
        return {v: r["state"] for v, r in self.ledger()["variants"].items()}

    def close(self) -> None:
        for proc in self.started:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        fake_tpu.power_off(list(self.root.glob("*/worker-*")))


@pytest.fixture
def stub_programme(tmp_path):
    programme = Programme(tmp_path)
    make_fake_workers(programme.root, 2, PROGRAMME_STUB, image=True)
    yield programme
    programme.close()


def write_plan(path: Path, hours: dict[str, float]) -> Path:
    """A plan CSV as `launch.py plan` writes it, with these variants' pod-hours."""
    from experiments import plan

    rows = [plan.Row(v.split("/")[0], v.split("/")[1], steps=10) for v in hours]
    plan.write_csv(rows, path)
    text = path.read_text().splitlines()
    head = text[0].split(",")
    fixed = [text[0]]
    for line in text[1:]:
        cells = line.split(",")
        key = f"{cells[0]}/{cells[1]}"
        if key in hours:
            cells[head.index("pod_hours")] = repr(hours[key])
        fixed.append(",".join(cells))
    path.write_text("\n".join(fixed) + "\n")
    return path


def test_the_budget_stops_the_queue_before_a_variant_that_would_exceed_it(stub_programme, tmp_path):
    plan_csv = write_plan(tmp_path / "plan.csv", {EMA[0]: 0.9, EMA[1]: 1.0})
    r = stub_programme.submit("--budget", "1", "--plan", str(plan_csv), "--run")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr
    budget = [line for line in r.stdout.splitlines() if line.startswith("budget:")]
    assert len(budget) == 1 and f"{EMA[1]} not started" in budget[0] and "> budget 1" in budget[0], r.stdout[-2000:]
    assert stub_programme.states() == {EMA[0]: "completed", EMA[1]: "queued"}
    with fake_tpu.control(stub_programme.root) as state:
        assert state["tpus"] == {}  # nothing left for the slice: deleted
    status = stub_programme.command("status")
    assert status.returncode == 0, status.stderr
    assert "exp08/ema0.99" in status.stdout and "eval/exact_accuracy=0.25" in status.stdout and "0.000/0.900" in status.stdout
    assert "controller: budget" in status.stdout
    page = (stub_programme.state_dir / NAME / "status.html").read_text()
    assert "<table>" in page and "data:image/png;base64," in page


def test_a_second_controller_is_refused_and_a_dead_ones_lease_taken_over(stub_programme, tmp_path):
    assert stub_programme.submit().returncode == 0
    gate = tmp_path / "gate"
    first = stub_programme.start(STUB_GATE=str(gate))
    wait_for(lambda: "running" in stub_programme.states().values() and
             "launch " in (stub_programme.state_dir / NAME / "controller.log").read_text(),
             timeout=60, what="the first controller's launch", procs=[first])
    second = stub_programme.command("run")
    assert second.returncode == 2, second.stdout + second.stderr
    error_line(second.stderr, f"another controller runs programme {NAME}", f"pid {first.pid}", last=True)
    os.kill(first.pid, signal.SIGKILL)  # its launch goes on on the workers
    first.wait()
    gate.touch()
    third = stub_programme.command("run", timeout=120)
    assert third.returncode == 0, third.stdout[-3000:] + third.stderr
    assert "took over the lease" in third.stderr + third.stdout and f"process {first.pid} is gone" in third.stderr + third.stdout
    assert stub_programme.states() == {EMA[0]: "completed", EMA[1]: "completed"}
    assert "stopped-stale-processes" in third.stdout  # the killed controller's launch was stopped, then resumed


def test_the_same_quota_refusal_on_three_variants_stops_the_controller(tmp_path):
    programme = Programme(tmp_path, FAKE_GCLOUD_CREATE_ERROR="RESOURCE_EXHAUSTED")
    make_fake_workers(programme.root, 2, PROGRAMME_STUB, image=True)
    try:
        variants = [*EMA, "exp08/ema0.995"]
        r = programme.submit("--create-attempts", "1", "--run", variants=variants)
        assert r.returncode == 1, r.stdout[-3000:] + r.stderr
        line = error_line(r.stderr, "the same infrastructure failure ended 3 variants in a row", "quota",
                          "RESOURCE_EXHAUSTED", last=True)
        assert "programme run prog" in line
        assert set(programme.states().values()) == {"queued"}  # none ran; each is there for the next run
        creates = [c for c in gcloud_calls(tmp_path / "gcloud.jsonl") if c[4] == "create"]
        assert len(creates) == 3
    finally:
        programme.close()


def test_preflight_is_one_line_per_variant_and_commands_steer_the_queue(stub_programme):
    r = stub_programme.submit(overrides=("arch=tiny_transformer", "arch.heads=5"))
    assert r.returncode == 2 and not (stub_programme.state_dir / NAME).exists()
    lines = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
    assert [line.split()[1] for line in lines] == [f"{v}:" for v in EMA] and "arch.heads=5" in lines[0], r.stderr

    variants = [*EMA, "exp08/ema0.995"]
    assert stub_programme.submit(variants=variants).returncode == 0
    assert stub_programme.command("skip", "exp08/ema0.995").returncode == 0
    r = stub_programme.command("run", timeout=120)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr
    assert stub_programme.states() == {EMA[0]: "completed", EMA[1]: "completed", "exp08/ema0.995": "skipped"}
    bad = stub_programme.env.copy()
    assert stub_programme.command("retry", "exp08/ema0.995").returncode == 0
    stub_programme.env = dict(bad, STUB_BAD="exp08/ema0.995")
    r = stub_programme.command("run", timeout=120)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr
    record = stub_programme.ledger()["variants"]["exp08/ema0.995"]
    assert record["state"] == "failed" and record["line"] == "exp08/ema0.995: the stub's bad input"
    assert stub_programme.command("retry", "nope/x").returncode == 2
