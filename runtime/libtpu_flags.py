"""The libtpu options every TPU process of the project starts with (LIBTPU_INIT_ARGS): training,
`compile_only` and the plan's compiles alike, so a plan prices the program a run executes.

Collective matmuls ("windowed einsum") are off. XLA would otherwise split each FSDP all-gather or
reduce-scatter that feeds an einsum into a loop of collective-permutes and partial products. By
the TPU compiler's own cost model the split products cost more compute than all the collectives
they could hide: gemma1_2b_full on v5e-8 is 426 ms of compute with them, and 283 ms of compute
plus 90 ms of collectives (counted as not overlapped) without. Data-parallel steps (the TRM and
HRM programme on v4-64) have no such einsums and compile the same either way.

A flag the user already sets in LIBTPU_INIT_ARGS keeps the user's value. These flags must exist
in the pinned libtpu (setup_tpu.sh): libtpu refuses to start on a flag it does not know.
"""

from __future__ import annotations

import os
import re
from typing import MutableMapping

DEFAULTS: tuple[tuple[str, str], ...] = (
    ("xla_tpu_enable_windowed_einsum_for_all_gather", "false"),
    ("xla_tpu_enable_windowed_einsum_for_reduce_scatter", "false"),
)


def with_defaults(args: str) -> str:
    """`args` (LIBTPU_INIT_ARGS) with each of DEFAULTS it does not set appended."""
    present = set(re.findall(r"--(\w+)(?:=|\s|$)", args))
    return " ".join([args.strip(), *(f"--{flag}={value}" for flag, value in DEFAULTS if flag not in present)]).strip()


def apply(environ: MutableMapping[str, str] = os.environ) -> None:
    """Set LIBTPU_INIT_ARGS with the defaults, before libtpu starts (it reads them once)."""
    environ["LIBTPU_INIT_ARGS"] = with_defaults(environ.get("LIBTPU_INIT_ARGS", ""))
