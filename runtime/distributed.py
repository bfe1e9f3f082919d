"""Joining the processes of a job into one JAX runtime.

`initialize` is the one entry point. It picks a mode:
- explicit: coordinator address, process count and process id from the config, or from
  JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID (the local pod simulator
  sets these), or derived from the TPU VM's worker metadata (TPU_WORKER_ID and
  TPU_WORKER_HOSTNAMES in the environment, else the metadata server's agent-worker-number
  and worker-network-endpoints): worker 0 hosts the coordinator;
- cluster: the values of JAX's own auto-detection (its detectors, run before joining), used
  on a TPU VM of a multi-host slice (single or multislice) or another environment JAX recognises;
- single: nothing to join.
In `auto` mode a detected cluster comes first; if detection fails and explicit values are
known, the explicit path is the fallback. Timeouts are bounded and deliberate, and an
unreachable coordinator is one clear error, not a hang.

Before JAX joins, every process passes our start-up barrier (runtime/liveness.py, on process
0's `distributed.liveness_port`, default the coordinator's port + 1): processes that do not all
come within `distributed.initialization_timeout_s` get one line naming the missing ones (exit 2)
instead of JAX's abort, and the barrier's connections then watch for a dead peer (exit 7).
"""

from __future__ import annotations

import logging
import os
import re
import socket
import threading
from dataclasses import dataclass, field
from typing import Mapping, Optional, Sequence, TypedDict

import jax

from runtime import events, gce_metadata, liveness
from runtime.config import DistributedConfig
from runtime.errors import EXIT_USER_ERROR, UserError, one_line
from runtime.jax_internals import cluster_detected, detected_cluster, on_cloud_tpu_vm
from runtime.watchdog import progress_phrase

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Explicit:
    coordinator_address: str
    num_processes: int
    process_id: int
    source: str
    hosts: tuple[str, ...] = field(default=(), compare=False)  # each process's host, where known beforehand
    local_device_ids: Optional[Sequence[int]] = field(default=None, compare=False)  # from JAX's cluster detection


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
            return _checked(source, str(address), count, pid, cfg.port, hostnames if source == TPU_METADATA else ())
        if any(given) and source in _PARTS:  # half a coordinator is a mistake, never "single process"
            names = _PARTS[source]
            missing = [n for n, g in zip(names, given) if not g]
            raise UserError(f"{', '.join(missing)} missing: give all three of {', '.join(names)}, or none")
    endpoints = worker_metadata(env)
    if endpoints is not None:
        worker, hosts = endpoints
        return _checked(TPU_METADATA, hosts[0], len(hosts), worker, cfg.port, hosts)
    return None


TPU_METADATA = "TPU worker metadata"
# The sources whose three values must come together (their names as the user sets them).
_PARTS = {"config": ("distributed.coordinator_address", "distributed.num_processes", "distributed.process_id"),
          "environment": ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")}


def _checked(source: str, address: str, count, pid, port: int, hosts: Sequence[str] = ()) -> Explicit:
    try:
        count, pid = int(count), int(pid)
    except ValueError:
        raise UserError(f"distributed values from {source} are not integers: num_processes={count!r} process_id={pid!r}")
    if not 0 <= pid < count:
        raise UserError(f"process_id {pid} is outside [0, {count}) (from {source}); give each worker a distinct id "
                        "below num_processes")
    return Explicit(_with_port(address, port), count, pid, source, tuple(hosts))


def worker_metadata(env: Mapping[str, str]) -> Optional[tuple[int, list[str]]]:
    """(worker number, worker hosts) from the TPU VM metadata server, or None off a TPU VM.

    Asked only on a TPU VM or when GCE_METADATA_IP points at a metadata server (as JAX honours
    it), so machines without one never wait on it.
    """
    if env.get("GCE_METADATA_IP") is None and not on_cloud_tpu_vm():
        return None
    try:
        worker = int(metadata_attribute("agent-worker-number", env))
        # Either plain hostnames or name:id:ip triples.
        hosts = [e.split(":")[-1] for e in metadata_attribute("worker-network-endpoints", env).split(",") if e.strip()]
    except (OSError, ValueError) as e:
        log.warning("TPU VM metadata server gave no worker endpoints (%s)", e)
        return None
    return (worker, hosts) if hosts else None


def metadata_attribute(key: str, env: Mapping[str, str]) -> str:
    """One attribute of this VM (e.g. accelerator-type) from the GCE metadata server: the one at
    GCE_METADATA_IP when set (as JAX honours it), else metadata.google.internal. OSError when it
    does not answer (no metadata server here), within 5 s."""
    return gce_metadata.get(f"instance/attributes/{key}", env)


def detected_values(cfg: DistributedConfig, env: Mapping[str, str]) -> tuple[Optional[Explicit], str]:
    """The values JAX's cluster auto-detection would join with (its own detectors, run before joining
    so that the start-up barrier can use them), or None and why not."""
    try:
        address, count, pid, local_ids = detected_cluster(env.get("JAX_COORDINATOR_ADDRESS"),
                                                          cfg.initialization_timeout_s)
    except Exception as e:  # noqa: BLE001 - a detector that cannot reach its metadata
        return None, _short(e)
    if None in (address, count, pid):
        return None, "no known cluster environment"
    return Explicit(str(address), int(count), int(pid), "cluster", local_device_ids=local_ids), ""


def _liveness_address(cfg: DistributedConfig, values: Explicit) -> tuple[str, int]:
    """Process 0's host and its liveness port, checked against the coordinator's (the settings'
    own ranges are checked with the config: runtime/config.py)."""
    host, _, port = values.coordinator_address.rpartition(":")
    host = host.strip("[]")
    try:
        coordinator_port = int(port)
        if values.process_id != 0:
            socket.getaddrinfo(host, coordinator_port)
    except (socket.gaierror, ValueError) as e:
        raise UserError(f"coordinator address {values.coordinator_address!r} does not resolve ({e}); set "
                        "distributed.coordinator_address to worker 0's host:port")
    live_port = cfg.liveness_port if cfg.liveness_port is not None else coordinator_port + 1
    if not 0 < live_port < 65536 or live_port == coordinator_port:
        raise UserError(f"distributed.liveness_port={live_port} must be a TCP port (1-65535) other than the "
                        f"coordinator's ({coordinator_port}), open between workers and the same on each")
    return host, live_port


def _join(cfg: DistributedConfig, values: Explicit, hosts: Sequence[str], mode: str) -> ProcessInfo:
    """The start-up barrier (every process joined, or one line naming who did not), the liveness
    channel, then JAX's own join: it starts only now, so its deadline always comes after ours."""
    if values.num_processes > 1:  # (a detected cluster may be one process)
        host, live_port = _liveness_address(cfg, values)
        if values.process_id == 0:
            log.info("coordinator for %d processes at %s; waiting up to %ds for all to join (liveness port %d)",
                     values.num_processes, values.coordinator_address, cfg.initialization_timeout_s, live_port)
        liveness.rendezvous(host, live_port, values.process_id, values.num_processes,
                            join_timeout_s=cfg.initialization_timeout_s, liveness_timeout_s=cfg.liveness_timeout_s,
                            progress=progress_phrase, coordinator=values.coordinator_address, hosts=hosts)
    # Every process is there, so JAX's join is quick unless its port is blocked; JAX would then abort
    # (SIGABRT) at its deadline: say it in one line just before.
    before_jax = max(1.0, cfg.initialization_timeout_s - 2)
    line = (f"JAX's coordinator {values.coordinator_address} did not connect all {values.num_processes} processes "
            f"within {before_jax:g}s although all passed the start-up barrier: open its port between workers "
            "(distributed.port), or raise distributed.initialization_timeout_s")
    timer = threading.Timer(before_jax, liveness.stop, (line, EXIT_USER_ERROR))
    timer.daemon = True
    timer.start()
    try:
        jax.distributed.initialize(
            coordinator_address=values.coordinator_address,
            num_processes=values.num_processes,
            process_id=values.process_id,
            local_device_ids=values.local_device_ids,
            **_timeouts(cfg),
        )
    except Exception as e:
        raise UserError(
            f"could not join coordinator {values.coordinator_address} as process {values.process_id}/"
            f"{values.num_processes} within {cfg.initialization_timeout_s}s ({_short(e)}); check that every worker "
            "was started, the address is worker 0's, and the port is open"
        ) from e
    finally:
        timer.cancel()
    return _process_info(mode)


def initialize(cfg: DistributedConfig, env: Mapping[str, str] | None = None) -> ProcessInfo:
    """Join the job (or not) and return who this process is. Call once, before any jax op.

    In auto mode, values the user gave (config or JAX_* environment) are used as given;
    otherwise a detected cluster is joined with the values of JAX's auto-detection, with the TPU
    worker metadata as the explicit fallback when detection fails.
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
        detected, why = detected_values(cfg, env)
        if detected is not None:
            same = explicit is not None and explicit.num_processes == detected.num_processes
            return _join(cfg, detected, explicit.hosts if explicit is not None and same else (), "cluster")
        if explicit is None:
            raise UserError(f"JAX cluster auto-detection failed ({why}); pass distributed.coordinator_address, "
                            "distributed.num_processes and distributed.process_id explicitly")
        log.warning("cluster auto-detection failed (%s); falling back to %s", why, explicit.source)
    if explicit is None or explicit.num_processes == 1:
        return _process_info("single")
    return _join(cfg, explicit, explicit.hosts, "explicit")


class _Timeouts(TypedDict):
    """jax.distributed.initialize's timeout arguments, by name."""
    initialization_timeout: int
    heartbeat_timeout_seconds: int
    shutdown_timeout_seconds: int


def _timeouts(cfg: DistributedConfig) -> _Timeouts:
    return _Timeouts(
        initialization_timeout=cfg.initialization_timeout_s,
        heartbeat_timeout_seconds=cfg.heartbeat_timeout_s,
        shutdown_timeout_seconds=cfg.shutdown_timeout_s,
    )


def _short(e: BaseException) -> str:
    return one_line(e)[:300]


# libtpu refusing to start because another process holds this worker's TPU ("The TPU is already in
# use by process with pid N", or its lockfile /tmp/libtpu_lockfile).
_TPU_BUSY = re.compile(r"TPU is already in use|libtpu_lockfile", re.IGNORECASE)


class TpuBusy(UserError):
    """Another process holds this worker's TPU: exit 2, class tpu-busy (a supervisor stops the stale
    processes and relaunches)."""

    failure = events.Failure.TPU_BUSY


def _process_info(mode: str) -> ProcessInfo:
    try:
        devices = jax.devices()  # the first touch of the backend: libtpu starts here
    except RuntimeError as e:
        if _TPU_BUSY.search(str(e)):
            raise TpuBusy(f"{_short(e)}; free the TPU: `python experiments/launch.py stop --tpu NAME --zone ZONE` "
                          "stops stale processes on every worker") from None
        raise
    info = ProcessInfo(
        mode=mode,
        process_index=jax.process_index(),
        process_count=jax.process_count(),
        local_devices=jax.local_device_count(),
        global_devices=jax.device_count(),
        platform=devices[0].platform,
    )
    print(info.line(), flush=True)  # every process says who it is, once
    return info
