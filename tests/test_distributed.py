"""Distributed init: where the explicit values come from, the fallback order, and a real
2-process join through the TPU VM metadata path (a metadata server on loopback per worker)."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest

from helpers import REPO, MetadataServer, base_overrides, child_env, free_port
from runtime import distributed
from runtime.config import DistributedConfig
from runtime.errors import UserError


def test_explicit_values_sources_and_order():
    cfg = DistributedConfig(port=9999)
    assert distributed.explicit_values(cfg, {}) is None
    env = {"JAX_COORDINATOR_ADDRESS": "10.0.0.2:1234", "JAX_NUM_PROCESSES": "4", "JAX_PROCESS_ID": "3"}
    assert distributed.explicit_values(cfg, env) == distributed.Explicit("10.0.0.2:1234", 4, 3, "environment")
    tpu = {"TPU_WORKER_HOSTNAMES": "10.0.0.5,10.0.0.6,10.0.0.7", "TPU_WORKER_ID": "2"}
    assert distributed.explicit_values(cfg, tpu) == distributed.Explicit("10.0.0.5:9999", 3, 2, distributed.TPU_METADATA)
    # config beats the environment, which beats the TPU worker variables
    cfg = DistributedConfig(coordinator_address="host0", num_processes=2, process_id=1, port=7777)
    assert distributed.explicit_values(cfg, env | tpu) == distributed.Explicit("host0:7777", 2, 1, "config")
    assert distributed.explicit_values(DistributedConfig(), env | tpu).source == "environment"


@pytest.mark.parametrize("cfg,env,message", [
    (DistributedConfig(coordinator_address="h:1"), {}, "distributed.num_processes, distributed.process_id missing"),
    (DistributedConfig(coordinator_address="h:1", num_processes=2, process_id=2), {}, "process_id 2 is outside [0, 2)"),
    (DistributedConfig(), {"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "two", "JAX_PROCESS_ID": "0"},
     "not integers"),
])
def test_bad_explicit_values(cfg, env, message):
    with pytest.raises(UserError, match=message.replace("[", r"\[").replace(")", r"\)")):
        distributed.explicit_values(cfg, env)


def worker_attributes(worker: int, endpoints: str) -> dict[str, str]:
    """The two attributes of a TPU VM worker that the coordinator is derived from."""
    return {"agent-worker-number": str(worker), "worker-network-endpoints": endpoints}


def test_worker_metadata_from_metadata_server():
    server = MetadataServer(worker_attributes(1, "unknown:unknown:10.1.0.4,unknown:unknown:10.1.0.5"))
    try:
        assert distributed.worker_metadata({"GCE_METADATA_IP": server.address}) == (1, ["10.1.0.4", "10.1.0.5"])
        explicit = distributed.explicit_values(DistributedConfig(port=8482), {"GCE_METADATA_IP": server.address})
        assert explicit == distributed.Explicit("10.1.0.4:8482", 2, 1, distributed.TPU_METADATA)
    finally:
        server.close()


@pytest.fixture
def joins(monkeypatch):
    """jax.distributed.initialize and the start-up barrier, recorded instead of run."""
    calls = {"barrier": [], "jax": []}
    monkeypatch.setattr(distributed.liveness, "rendezvous", lambda *a, **kw: calls["barrier"].append((a, kw)))
    monkeypatch.setattr(distributed.jax.distributed, "initialize", lambda **kw: calls["jax"].append(kw))
    monkeypatch.setattr(distributed.jax.distributed, "is_initialized", lambda: False)
    monkeypatch.setattr(distributed, "cluster_detected", lambda: True)
    return calls


def test_detected_cluster_passes_the_barrier_before_jax_joins(joins, monkeypatch):
    monkeypatch.setattr(distributed, "detected_values",
                        lambda cfg, env: (distributed.Explicit("10.0.0.5:8482", 3, 2, "cluster"), ""))
    env = {"TPU_WORKER_HOSTNAMES": "10.0.0.5,10.0.0.6,10.0.0.7", "TPU_WORKER_ID": "2"}
    distributed.initialize(DistributedConfig(initialization_timeout_s=7), env)
    (args, kwargs), = joins["barrier"]
    assert args == ("10.0.0.5", 8483, 2, 3) and kwargs["join_timeout_s"] == 7  # liveness port: coordinator's + 1
    assert kwargs["hosts"] == ("10.0.0.5", "10.0.0.6", "10.0.0.7")  # to name the missing ones
    assert joins["jax"][0]["coordinator_address"] == "10.0.0.5:8482" and joins["jax"][0]["process_id"] == 2


def test_detection_failure_falls_back_to_worker_metadata(joins, monkeypatch):
    monkeypatch.setattr(distributed, "detected_values", lambda cfg, env: (None, "auto-detection broke"))
    env = {"TPU_WORKER_HOSTNAMES": "127.0.0.1,127.0.0.2", "TPU_WORKER_ID": "1"}
    distributed.initialize(DistributedConfig(port=1234, initialization_timeout_s=7, liveness_port=4321), env)
    assert joins["barrier"][0][0] == ("127.0.0.1", 4321, 1, 2)
    call, = joins["jax"]
    assert call["coordinator_address"] == "127.0.0.1:1234" and call["process_id"] == 1
    assert call["num_processes"] == 2 and call["initialization_timeout"] == 7

    with pytest.raises(UserError, match=r"auto-detection failed \(auto-detection broke\)"):  # no fallback
        distributed.initialize(DistributedConfig(), {})


def test_jax_join_after_the_barrier_ends_in_one_line_before_its_own_abort(joins, monkeypatch):
    stopped, said = threading.Event(), []
    monkeypatch.setattr(distributed.liveness, "stop", lambda line, code: (said.append((line, code)), stopped.set()))
    monkeypatch.setattr(distributed.jax.distributed, "initialize", lambda **kw: stopped.wait(30))  # a blocked port
    env = {"JAX_COORDINATOR_ADDRESS": "127.0.0.1:1234", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "0"}
    distributed.initialize(DistributedConfig(initialization_timeout_s=3), env)
    assert said == [("JAX's coordinator 127.0.0.1:1234 did not connect all 2 processes within 1s although all "
                     "passed the start-up barrier: open its port between workers (distributed.port), or raise "
                     "distributed.initialization_timeout_s", 2)]


@pytest.mark.parametrize("cfg,coordinator,message", [
    (DistributedConfig(liveness_port=1234), "127.0.0.1:1234", "distributed.liveness_port=1234 must be a TCP port "
                                                              "(1-65535) other than the coordinator's (1234)"),
    # the default, the coordinator's port + 1, past the last port (the settings' own ranges: the config's checks)
    (DistributedConfig(), "127.0.0.1:65535", "distributed.liveness_port=65536 must be a TCP port"),
])
def test_bad_liveness_settings(joins, cfg, coordinator, message):
    env = {"JAX_COORDINATOR_ADDRESS": coordinator, "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "0"}
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
        distributed.initialize(cfg, env)
    assert joins["barrier"] == [] and joins["jax"] == []  # found before anything waits


@pytest.mark.slow
def test_two_workers_join_through_metadata_server(sudoku_dir, tmp_path):
    port = free_port()
    servers = [MetadataServer(worker_attributes(i, "127.0.0.1,127.0.0.1")) for i in range(2)]
    try:
        procs = [subprocess.Popen(
            [sys.executable, str(REPO / "pretrain_jax.py"), *base_overrides(sudoku_dir, tmp_path, steps=2),
             f"distributed.port={port}", "distributed.initialization_timeout_s=60"],
            cwd=REPO, env=child_env(1, GCE_METADATA_IP=servers[i].address), stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True) for i in range(2)]
        outputs = [p.communicate(timeout=240)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
        for s in servers:
            s.close()
    for i, (p, out) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, out[-3000:]
        assert f"process {i}/2, local devices 1, global devices 2, platform cpu (explicit)" in out
