"""The 8 symmetries of the square (dihedral group D4) acting on 2-D grids.

Transform ids follow the TinyRecursiveModels numbering, so augmentation names
written by either builder ("...|||t<id>|||...") mean the same transform:

    0 identity          4 mirror left-right
    1 rotate 90 (CCW)   5 mirror up-down
    2 rotate 180        6 transpose (main diagonal)
    3 rotate 270 (CCW)  7 anti-transpose (anti-diagonal)

Every function acts on the LAST two axes, so a batch [..., H, W] works too.
"""

from __future__ import annotations

import numpy as np

NUM_TRANSFORMS = 8
# INVERSE[t] undoes t: the rotations by 90 and 270 undo each other, the rest are involutions.
INVERSE = (0, 3, 2, 1, 4, 5, 6, 7)


def _check(tid: int) -> int:
    tid = int(tid)
    if not 0 <= tid < NUM_TRANSFORMS:
        raise ValueError(f"dihedral transform id must be in [0, {NUM_TRANSFORMS}), got {tid}")
    return tid


def dihedral_transform(grid: np.ndarray, tid: int) -> np.ndarray:
    """Apply transform `tid` to the last two axes of `grid` (returns a view where numpy can)."""
    tid = _check(tid)
    a = np.asarray(grid)
    if a.ndim < 2:
        raise ValueError(f"expected an array with at least 2 dims, got shape {a.shape}")
    axes = (a.ndim - 2, a.ndim - 1)
    if tid <= 3:
        return np.rot90(a, k=tid, axes=axes)
    if tid == 4:
        return np.flip(a, axis=-1)
    if tid == 5:
        return np.flip(a, axis=-2)
    if tid == 6:
        return np.swapaxes(a, -1, -2)
    # 7: reflect across the anti-diagonal = rotate 180 of the transpose.
    return np.rot90(np.swapaxes(a, -1, -2), k=2, axes=axes)


def inverse_dihedral_transform(grid: np.ndarray, tid: int) -> np.ndarray:
    """Undo `dihedral_transform(., tid)`."""
    return dihedral_transform(grid, INVERSE[_check(tid)])


def transformed_shape(shape: tuple[int, int], tid: int) -> tuple[int, int]:
    """(rows, cols) of a (rows, cols) grid after transform `tid`."""
    rows, cols = shape
    return (cols, rows) if _check(tid) in (1, 3, 6, 7) else (rows, cols)
