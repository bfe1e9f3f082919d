"""Train a model on a device mesh: `python pretrain_jax.py [hydra overrides]`.

Examples:
  python pretrain_jax.py                                   # embedded defaults, CPU devices
  python pretrain_jax.py +experiment=<group>/<variant>     # one variant of an experiment group
  python pretrain_jax.py -m +experiment=<group>/a,<group>/b   # sweep
  python pretrain_jax.py --cfg job                         # print the composed config

Every process of a pod runs this same command (see experiments/launch.py).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

# Hydra re-raises instead of printing a multi-line report; main() turns errors into one line.
os.environ["HYDRA_FULL_ERROR"] = "1"

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from runtime.config import register_schemas, validate
from runtime import events, liveness
from runtime.errors import EXIT_INTERRUPTED, EXIT_PREEMPTED, UserError, interrupted
from runtime.goodput import process_start
from runtime.hydra_compose import config_error
from runtime.job import failed, run_job

CONF_DIR = str(Path(__file__).resolve().parent / "conf")
register_schemas()
# The first run's time account starts when this process did (its imports count); the later jobs
# of a sweep (-m), run one after the other in this process, start their own.
_PROCESS_START = [process_start()]


def _exit(code: int) -> None:
    """Exit with `code`. A failed or preempted run leaves at once (after its own cleanup, already
    done): a normal exit would wait for background threads (Orbax/tensorstore retrying a dead
    storage endpoint, W&B's exit hook on a service a VM shutdown killed) and, in a multi-process
    job, in JAX's shutdown barrier for peers that may never arrive. The other processes of a pod
    hear of it first (runtime/liveness.py); a preempted one leaves like a finished one."""
    liveness.leave(0 if code == EXIT_PREEMPTED else code)
    if code:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


def _swept_values(hydra_cfg) -> str | None:
    """In a sweep (-m), this job's values of the swept keys, e.g. "train.seed=1"; else None.

    The swept keys are the ones Hydra's sweeper expanded: its `hydra.sweeper.params` and the
    sweep overrides of the multirun's own command line, which the sweeper saves before the first
    job in <hydra.sweep.dir>/multirun.yaml (the experiment choice names the run already)."""
    if hydra_cfg.mode != RunMode.MULTIRUN:
        return None
    try:
        sweep = OmegaConf.load(Path(hydra_cfg.runtime.cwd) / hydra_cfg.sweep.dir / "multirun.yaml").hydra
        given = [f"{k}={v}" for k, v in (sweep.sweeper.get("params") or {}).items()] + list(sweep.overrides.task)
        parsed = OverridesParser.create().parse_overrides(given)
    except Exception:  # noqa: BLE001 - no record of the sweep: the job's number still keeps runs apart
        return f"job{hydra_cfg.job.num}"
    swept = {o.get_key_element() for o in parsed if o.is_sweep_override()} - {"experiment", "+experiment"}
    return ",".join(t for t in hydra_cfg.overrides.task if t.split("=", 1)[0] in swept) or None


@hydra.main(version_base=None, config_path=CONF_DIR, config_name="config")
def _hydra_main(cfg: DictConfig) -> None:
    hydra_cfg = HydraConfig.get()
    code = run_job(lambda: validate(cfg, hydra_cfg.runtime.choices.get("experiment"),
                                    sweep_job=_swept_values(hydra_cfg)),
                   started=_PROCESS_START.pop() if _PROCESS_START else None)
    if code:
        _exit(code)


def main() -> None:
    try:
        _hydra_main()
    except Exception as e:
        if not isinstance(e, UserError) and config_error(e) is None:  # not a config that failed to compose
            raise
        _exit(failed(e))
    except KeyboardInterrupt:  # Ctrl-C wherever it lands: one line and 130, no traceback (as SIGTERM ends clean)
        line = interrupted("stopped before the end; the same command resumes a run from its last checkpoint")
        print(f"error: {line}", file=sys.stderr, flush=True)
        events.failed(EXIT_INTERRUPTED, line)
        _exit(EXIT_INTERRUPTED)


if __name__ == "__main__":
    main()
