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
import traceback
from pathlib import Path

# Hydra re-raises instead of printing a multi-line report; main() turns errors into one line.
os.environ["HYDRA_FULL_ERROR"] = "1"

import hydra  # noqa: E402
from hydra.core.hydra_config import HydraConfig  # noqa: E402
from hydra.core.override_parser.overrides_parser import OverridesParser  # noqa: E402
from hydra.types import RunMode  # noqa: E402
from omegaconf import DictConfig, OmegaConf  # noqa: E402

from data_pipeline.puzzle_format import end_progress_bars  # noqa: E402
from runtime.config import register_schemas, validate  # noqa: E402
from runtime import events, libtpu_flags, liveness  # noqa: E402
from runtime.compile_only import plan_for_topology  # noqa: E402
from runtime.cpu_backend import tune_cpu_backend  # noqa: E402
from runtime.goodput import process_start  # noqa: E402
from runtime.trainer import run  # noqa: E402
from runtime.errors import EXIT_FAILURE, EXIT_PREEMPTED, UserError, one_line  # noqa: E402
from runtime.hydra_compose import config_error  # noqa: E402

CONF_DIR = str(Path(__file__).resolve().parent / "conf")
register_schemas()
# The first run's time account starts when this process did (its imports count); the later jobs
# of a sweep (-m), run one after the other in this process, start their own.
_PROCESS_START = [process_start()]
# Called with the exit code just before this process exits through `_exit` (a resident trainer
# says how its run ended before it goes: experiments/launcher/worker/resident.py).
BEFORE_EXIT: list = []


def _exit(code: int) -> None:
    """Exit with `code`. A failed or preempted run leaves at once (after its own cleanup, already
    done): a normal exit would wait for background threads (Orbax/tensorstore retrying a dead
    storage endpoint, W&B's exit hook on a service a VM shutdown killed) and, in a multi-process
    job, in JAX's shutdown barrier for peers that may never arrive. The other processes of a pod
    hear of it first (runtime/liveness.py); a preempted one leaves like a finished one."""
    if code not in (0, EXIT_PREEMPTED):  # said already where it failed; else its code at least
        events.failed(code, f"exited with code {code}; the log above says why")
    liveness.leave(0 if code == EXIT_PREEMPTED else code)
    for hook in BEFORE_EXIT:
        hook(code)
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


def _failing() -> None:
    """In a pod, a failure can be the echo of a peer that died (a collective, a checkpoint barrier):
    the liveness channel names that peer instead, and exits, if it finds one (runtime/liveness.py)."""
    liveness.failing()


def _user_error(e: UserError) -> None:
    _failing()
    end_progress_bars()  # a dataset build's bar cut short: the line starts a line of its own
    print(f"error: {e}", file=sys.stderr, flush=True)
    events.failed(e.exit_code, str(e), events.failure_of(e))
    _exit(e.exit_code)


@hydra.main(version_base=None, config_path=CONF_DIR, config_name="config")
def _hydra_main(cfg: DictConfig) -> None:
    try:
        hydra_cfg = HydraConfig.get()
        config = validate(cfg, hydra_cfg.runtime.choices.get("experiment"), sweep_job=_swept_values(hydra_cfg))
        libtpu_flags.apply()  # before JAX starts a TPU backend (runtime/libtpu_flags.py)
        if config.compile_only:  # compile for a TPU topology, print memory and FLOPs, exit without training
            code = plan_for_topology(config)
        else:
            tune_cpu_backend()  # CPU runs: before JAX starts its backend (runtime/cpu_backend.py)
            code = run(config, started=_PROCESS_START.pop() if _PROCESS_START else None)
    except UserError as e:  # exit here: Hydra would add its own line to a raised exception
        _user_error(e)
    except Exception as e:
        _failing()
        traceback.print_exc()
        events.failed(EXIT_FAILURE, one_line(e), events.failure_of(e))
        _exit(EXIT_FAILURE)
    if code:
        _exit(code)


def main() -> None:
    try:
        _hydra_main()
    except UserError as e:
        _user_error(e)
    except Exception as e:
        error = config_error(e)  # composing failed: Hydra, OmegaConf or a YAML file's syntax
        if error is None:
            raise
        print(f"error: {error}", file=sys.stderr, flush=True)
        events.failed(error.exit_code, str(error))
        sys.exit(error.exit_code)


if __name__ == "__main__":
    main()
