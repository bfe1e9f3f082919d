"""The one place that imports JAX's private modules (`jax._src`), each for what JAX's public API
does not offer (checked against jax 0.10). A JAX upgrade that moves one breaks here, and only here.

- `backends_started`: whether JAX has started its backends (xla_bridge). The CPU tuning
  (runtime/cpu_backend.py) sets flags the backend reads when it starts; `jax.devices()` would start it.
- `on_cloud_tpu_vm`: whether libtpu found a Cloud TPU VM (cloud_tpu_init), read after JAX started.
- `cluster_detected`, `detected_cluster`: JAX's cluster detectors (clusters.ClusterEnv), the ones
  `jax.distributed.initialize()` runs, run before joining so that our start-up barrier
  (runtime/liveness.py) knows the coordinator and the process count first (runtime/distributed.py).
"""

from __future__ import annotations

from typing import Any

from jax._src import cloud_tpu_init, clusters, xla_bridge


def backends_started() -> bool:
    started = getattr(xla_bridge, "backends_are_initialized", None)
    return started is None or started()  # a JAX without it: treat as started (leave its defaults)


def on_cloud_tpu_vm() -> bool:
    return bool(cloud_tpu_init.running_in_cloud_tpu_vm)  # read now: set when JAX initialises libtpu


def cluster_detected() -> bool:
    """Whether one of JAX's cluster detectors (not the opt-in ones) recognises this environment."""
    return any(not env.opt_in_only_method and env.is_env_present() for env in clusters.ClusterEnv._cluster_types)


def detected_cluster(coordinator_address: str | None, timeout_s: int) -> tuple[Any, Any, Any, Any]:
    """(coordinator address, process count, process id, local device ids) as JAX's detectors find them."""
    return clusters.ClusterEnv.auto_detect_unset_distributed_params(coordinator_address, None, None, None, None,
                                                                    timeout_s)
