"""Joining the processes of a job into one JAX runtime.

`initialize` is the one entry point. It picks a mode:
- explicit: coordinator address, process count and process id from the config, or from
  JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID (the local pod simulator
  sets these), or derived from the TPU VM's worker metadata (TPU_WORKER_ID and
  TPU_WORKER_HOSTNAMES in the environment, else the metadata server's agent-worker-number
  and worker-network-endpoints): worker 0 hosts the coordinator;
- cluster: JAX's own auto-detection (`jax.distributed.initialize()` with no arguments),
  used on a TPU VM of a multi-host slice or another environment JAX recognises;
- single: nothing to join.
In `auto` mode a detected cluster comes first; if detection fails and explicit values are
known, the explicit path is the fallback. Timeouts are bounded and deliberate, and an
unreachable coordinator is one clear error, not a hang.
"""

from __future__ import annotations

import logging
import os
import socket
import time
import urllib.request
from dataclasses import dataclass
from typing import Mapping, Optional

import jax

from runtime.config import DistributedConfig
from runtime.errors import UserError, one_line

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Explicit:
    coordinator_address: str
    num_processes: int
    process_id: int
    source: str


@dataclass(frozen=True)
class ProcessInfo:
    mode: str  # single | cluster | explicit
    process_index: int
    process_count: int
    local_devices: int
    global_devices: int
    platform: str

    @property
    def is_primary(self) -> bool:
        return self.process_index == 0

    def line(self) -> str:
        return (
            f"process {self.process_index}/{self.process_count}, local devices {self.local_devices}, "
            f"global devices {self.global_devices}, platform {self.platform} ({self.mode})"
        )


def _with_port(address: str, port: int) -> str:
    return address if ":" in address.rsplit("]", 1)[-1] else f"{address}:{port}"


def explicit_values(cfg: DistributedConfig, env: Mapping[str, str]) -> Optional[Explicit]:
    """Explicit coordinator values; the first complete source wins: config, JAX_* environment,
    TPU worker environment (TPU_WORKER_ID + TPU_WORKER_HOSTNAMES), TPU VM metadata server."""
    sources = [
        ("config", cfg.coordinator_address, cfg.num_processes, cfg.process_id),
        ("environment", env.get("JAX_COORDINATOR_ADDRESS"), env.get("JAX_NUM_PROCESSES"), env.get("JAX_PROCESS_ID")),
    ]
    hostnames = [h.strip() for h in env.get("TPU_WORKER_HOSTNAMES", "").split(",") if h.strip()]
    if hostnames and env.get("TPU_WORKER_ID") is not None:
        sources.append((TPU_METADATA, hostnames[0], len(hostnames), env["TPU_WORKER_ID"]))  # worker 0 coordinates
    for source, address, count, pid in sources:
        given = [v is not None and v != "" for v in (address, count, pid)]
        if all(given):
            return _checked(source, str(address), count, pid, cfg.port)
        if any(given) and source == "config":
            missing = [n for n, g in zip(("coordinator_address", "num_processes", "process_id"), given) if not g]
            raise UserError(f"distributed.{', distributed.'.join(missing)} missing: give all three of "
                            "coordinator_address, num_processes, process_id, or none")
    endpoints = worker_metadata(env)
    if endpoints is not None:
        worker, hosts = endpoints
        return _checked(TPU_METADATA, hosts[0], len(hosts), worker, cfg.port)
    return None


TPU_METADATA = "TPU worker metadata"


def _checked(source: str, address: str, count, pid, port: int) -> Explicit:
    try:
        count, pid = int(count), int(pid)
    except ValueError:
        raise UserError(f"distributed values from {source} are not integers: num_processes={count!r} process_id={pid!r}")
    if not 0 <= pid < count:
        raise UserError(f"process_id {pid} is outside [0, {count}) (from {source}); give each worker a distinct id "
                        "below num_processes")
    return Explicit(_with_port(address, port), count, pid, source)


def worker_metadata(env: Mapping[str, str]) -> Optional[tuple[int, list[str]]]:
    """(worker number, worker hosts) from the TPU VM metadata server, or None off a TPU VM.

    Asked only on a TPU VM or when GCE_METADATA_IP points at a metadata server (as JAX honours
    it), so machines without one never wait on it.
    """
    endpoint = env.get("GCE_METADATA_IP")
    if endpoint is None and not _on_tpu_vm():
        return None
    base = f"http://{endpoint or 'metadata.google.internal'}/computeMetadata/v1/instance/attributes"

    def get(key: str) -> str:
        request = urllib.request.Request(f"{base}/{key}", headers={"Metadata-Flavor": "Google"})
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.read().decode().strip()

    try:
        worker = int(get("agent-worker-number"))
        # Either plain hostnames or name:id:ip triples.
        hosts = [e.split(":")[-1] for e in get("worker-network-endpoints").split(",") if e.strip()]
    except (OSError, ValueError) as e:
        log.warning("TPU VM metadata server gave no worker endpoints (%s)", e)
        return None
    return (worker, hosts) if hosts else None


def _on_tpu_vm() -> bool:
    from jax._src.cloud_tpu_init import running_in_cloud_tpu_vm

    return bool(running_in_cloud_tpu_vm)


def cluster_detected() -> bool:
    """Whether JAX's auto-detection recognises this environment (TPU VM pod, SLURM, ...)."""
    from jax._src import clusters  # the detectors jax.distributed.initialize() itself runs

    return any(not env.opt_in_only_method and env.is_env_present() for env in clusters.ClusterEnv._cluster_types)


def _wait_for_coordinator(address: str, timeout_s: float) -> None:
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    try:
        socket.getaddrinfo(host, int(port))
    except (socket.gaierror, ValueError) as e:
        raise UserError(f"coordinator address {address!r} does not resolve ({e}); set distributed.coordinator_address "
                        "to worker 0's host:port")
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection((host, int(port)), timeout=2).close()
            return
        except OSError as e:
            if time.monotonic() >= deadline:
                raise UserError(f"coordinator {address} did not answer within {timeout_s}s ({e}); start process 0 "
                                "first or together with the others, check the address is worker 0's and the port is "
                                "open (distributed.port / distributed.initialization_timeout_s)")
            time.sleep(0.5)


def initialize(cfg: DistributedConfig, env: Mapping[str, str] | None = None) -> ProcessInfo:
    """Join the job (or not) and return who this process is. Call once, before any jax op.

    In auto mode, values the user gave (config or JAX_* environment) are used as given;
    otherwise a detected cluster is joined by JAX's auto-detection, with the TPU worker
    metadata as the explicit fallback when detection fails.
    """
    env = os.environ if env is None else env
    if jax.distributed.is_initialized():  # an earlier job of a Hydra -m sweep already joined
        return _process_info("explicit")
    if cfg.mode == "single":
        return _process_info("single")
    explicit = explicit_values(cfg, env) if cfg.mode in ("auto", "explicit") else None
    if cfg.mode == "explicit" and explicit is None:
        raise UserError("distributed.mode=explicit needs coordinator_address, num_processes and process_id "
                        "(config, JAX_* environment or TPU worker metadata)")
    user_given = explicit is not None and explicit.source != TPU_METADATA
    if cfg.mode == "cluster" or (cfg.mode == "auto" and not user_given and cluster_detected()):
        try:
            jax.distributed.initialize(**_timeouts(cfg))
            return _process_info("cluster")
        except Exception as e:  # detection or connection failed
            if explicit is None:
                raise UserError(f"JAX cluster auto-detection failed ({_short(e)}); pass distributed.coordinator_address, "
                                "distributed.num_processes and distributed.process_id explicitly") from e
            log.warning("cluster auto-detection failed (%s); falling back to %s", _short(e), explicit.source)
            _shutdown_quietly()
    if explicit is None or explicit.num_processes == 1:
        return _process_info("single")
    if explicit.process_id != 0:
        # JAX aborts the process (no Python exception) when it cannot reach the coordinator,
        # so find out first and say so in one line.
        _wait_for_coordinator(explicit.coordinator_address, cfg.initialization_timeout_s)
    else:
        log.info("coordinator for %d processes at %s; waiting up to %ds for all to join", explicit.num_processes,
                 explicit.coordinator_address, cfg.initialization_timeout_s)
    try:
        jax.distributed.initialize(
            coordinator_address=explicit.coordinator_address,
            num_processes=explicit.num_processes,
            process_id=explicit.process_id,
            **_timeouts(cfg),
        )
    except Exception as e:
        raise UserError(
            f"could not join coordinator {explicit.coordinator_address} as process {explicit.process_id}/"
            f"{explicit.num_processes} within {cfg.initialization_timeout_s}s ({_short(e)}); check that every worker "
            "was started, the address is worker 0's, and the port is open"
        ) from e
    return _process_info("explicit")


def _timeouts(cfg: DistributedConfig) -> dict[str, int]:
    return dict(
        initialization_timeout=cfg.initialization_timeout_s,
        heartbeat_timeout_seconds=cfg.heartbeat_timeout_s,
        shutdown_timeout_seconds=cfg.shutdown_timeout_s,
    )


def _short(e: BaseException) -> str:
    return one_line(e)[:300]


def _process_info(mode: str) -> ProcessInfo:
    info = ProcessInfo(
        mode=mode,
        process_index=jax.process_index(),
        process_count=jax.process_count(),
        local_devices=jax.local_device_count(),
        global_devices=jax.device_count(),
        platform=jax.devices()[0].platform,
    )
    print(info.line(), flush=True)  # every process says who it is, once
    return info


def _shutdown_quietly() -> None:
    try:
        jax.distributed.shutdown()
    except Exception:  # nothing was up
        pass
