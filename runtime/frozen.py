"""A dataclass mixin whose instances become read-only once `freeze` has run.

OmegaConf marks nodes of `frozen=True` dataclasses read-only, which breaks Hydra's merging of
overrides; so the config schema uses ordinary dataclasses with this mixin, frozen after
validation. Model config classes use it too (they are part of the same schema).
"""

from __future__ import annotations

import dataclasses
from typing import Any


class Freezable:
    def __setattr__(self, name: str, value: Any) -> None:
        if getattr(self, "_frozen", False):
            raise dataclasses.FrozenInstanceError(f"config is frozen; cannot set {name!r}")
        object.__setattr__(self, name, value)


def freeze(obj: Any) -> Any:
    """Freeze a dataclass tree in place and return it."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            freeze(getattr(obj, f.name))
        object.__setattr__(obj, "_frozen", True)
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            freeze(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            freeze(item)
    return obj
