"""The built-in dataset kinds; importing this package registers each (runtime/registry.py).

A new kind is one module here (a `runtime.registry.DatasetKind` subclass and its
`register_dataset_kind(...)` call) plus its import below.
"""

from data_pipeline.kinds import arc, maze, multitask, sft, sudoku  # noqa: F401  (each registers itself)
