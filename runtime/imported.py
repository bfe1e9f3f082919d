"""A directory of imported parameters (written by a family's importer, e.g.
`python -m models.recursive_reasoning.import_reference --out DIR`), local or gs://:

    DIR/params        Orbax item: the unboxed params tree
    DIR/init_states   Orbax item (optional): named vectors the family's model starts its
                      recurrent state from (TRM/HRM: H_init, L_init)

`train.init_params_from=DIR` starts a fresh run from it.
"""

from __future__ import annotations

import os
from typing import Any

import fsspec
import orbax.checkpoint as ocp


def orbax_dir(out_dir: str) -> str:
    return out_dir.rstrip("/") if "://" in out_dir else os.path.abspath(out_dir)  # Orbax wants absolute local paths


def load_imported_params(out_dir: str, abstract_params: Any = None) -> dict:
    """The params of an imported directory. `abstract_params` (ShapeDtypeStructs with
    shardings) places the arrays."""
    return ocp.StandardCheckpointer().restore(f"{orbax_dir(out_dir)}/params", abstract_params)


def load_imported_states(out_dir: str) -> dict | None:
    """The named init-state vectors of an imported directory, or None when it has none."""
    fs, base = fsspec.core.url_to_fs(out_dir)
    if not fs.exists(f"{base.rstrip('/')}/init_states"):
        return None
    return ocp.StandardCheckpointer().restore(f"{orbax_dir(out_dir)}/init_states")
