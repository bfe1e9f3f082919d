"""The config `pretrain_jax.py <overrides>` would run, composed in this process: the one Hydra compose
shared by the launchers (what a run's checkpoint directory will be), the research tools (what a
variant changes) and the tests.

`env` is an overlay of environment variables for `${oc.env:...}` (a programme's `--env
PODRUNNER_DATA=...` names the data on the workers): it is read through a context variable, so a
compose never changes `os.environ` and threads composing at once do not see each other's.

`config_error` turns a failure to compose (Hydra, OmegaConf, a YAML file's syntax) into the one
`error:` line a command prints.
"""

from __future__ import annotations

import contextlib
import contextvars
from pathlib import Path
from typing import Any, Iterator, Mapping, Optional, Sequence

import yaml
from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf._utils import _DEFAULT_MARKER_
from omegaconf.errors import OmegaConfBaseException
from omegaconf.resolvers import oc

from runtime.config import Config, register_schemas, validate
from runtime.errors import UserError, one_line

CONF = Path(__file__).resolve().parents[1] / "conf"
GROUP_CHOICES = ("arch", "data", "optim", "mesh", "run")  # the config groups a run chooses

_ENV: contextvars.ContextVar[Mapping[str, str]] = contextvars.ContextVar("podrunner_env_overlay", default={})


def _env(key: str, default: Any = _DEFAULT_MARKER_) -> Optional[str]:
    """OmegaConf's `oc.env`, with this context's overlay first."""
    overlay = _ENV.get()
    if key in overlay:
        return overlay[key]
    return oc.env(key, default)


@contextlib.contextmanager
def env_overlay(env: Mapping[str, str] | None) -> Iterator[None]:
    token = _ENV.set(dict(env or {}))
    try:
        yield
    finally:
        _ENV.reset(token)


def compose(overrides: Sequence[str], *, env: Mapping[str, str] | None = None,
            resolve: bool = False) -> tuple[DictConfig, dict[str, str]]:
    """(the composed config without its `hydra` node, the config-group choices), as the run composes
    it: `${hydra:...}` interpolations resolve as in the run (a checkpoint directory per experiment).
    `resolve`: interpolations resolved here, under the overlay (else when read)."""
    register_schemas()
    OmegaConf.register_new_resolver("oc.env", _env, replace=True, use_cache=False)
    with env_overlay(env), initialize_config_dir(config_dir=str(CONF), version_base=None):
        cfg = hydra_compose(config_name="config", overrides=list(overrides), return_hydra_config=True)
        HydraConfig.instance().set_config(cfg)
        choices = {k: cfg.hydra.runtime.choices[k] for k in GROUP_CHOICES if k in cfg.hydra.runtime.choices}
        with open_dict(cfg):
            del cfg["hydra"]
        if resolve:
            OmegaConf.resolve(cfg)
    return cfg, choices


def experiment_of(overrides: Sequence[str]) -> str | None:
    """`group/variant` of a `+experiment=...` override, if any."""
    return next((o.split("=", 1)[1] for o in overrides if o.lstrip("+").startswith("experiment=")), None)


def composed(overrides: Sequence[str], *, env: Mapping[str, str] | None = None) -> Config:
    """The validated Config that `pretrain_jax.py <overrides>` runs (UserError or Hydra's error if not)."""
    cfg, _ = compose(overrides, env=env)
    with env_overlay(env):
        return validate(cfg, experiment_of(overrides))


def config_error(exc: BaseException) -> UserError | None:
    """A failure to compose the config (Hydra, OmegaConf, a YAML file that does not parse) as a
    one-line UserError naming the file and the place; None for any other exception."""
    if isinstance(exc, yaml.MarkedYAMLError):
        mark = exc.problem_mark or exc.context_mark
        where = f"{mark.name} line {mark.line + 1} column {mark.column + 1}" if mark else "a config file"
        what = "; ".join(str(p) for p in (exc.context, exc.problem) if p)
        return UserError(f"invalid YAML in {where}: {what}; fix the file's syntax")
    if isinstance(exc, yaml.YAMLError):
        return UserError(f"invalid YAML in a config file: {one_line(exc)}; fix the file's syntax")
    if isinstance(exc, (HydraException, OmegaConfBaseException)):
        return UserError(f"invalid config: {one_line(exc)}")
    return None
