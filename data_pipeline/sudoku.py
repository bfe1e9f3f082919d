"""Sudoku solver, unique-solution puzzle generator and symmetry augmentation.

Grids are flat arrays of 81 cells in row-major order: 0 = blank, 1..9 = digit.
"""

from __future__ import annotations

import numpy as np

DEFAULT_MIN_GIVENS = 27

_ROW = [i // 9 for i in range(81)]
_COL = [i % 9 for i in range(81)]
_BOX = [(i // 27) * 3 + (i % 9) // 3 for i in range(81)]
_FULL = 0x1FF  # bit d-1 set = digit d used
# For each 9-bit "free digits" mask: its size and its (bit, digit) pairs.
_POPCOUNT = [m.bit_count() for m in range(512)]
_BITS = [tuple((1 << d, d + 1) for d in range(9) if m >> d & 1) for m in range(512)]


class _Board:
    """Bitmask state for backtracking: used digits per row/column/box and the blank cells."""

    def __init__(self, grid: np.ndarray):
        cells = [int(v) for v in np.asarray(grid).reshape(-1)]
        if len(cells) != 81 or min(cells) < 0 or max(cells) > 9:
            raise ValueError("a sudoku grid is 81 cells holding 0 (blank) or 1..9")
        self.cells = cells
        self.rows, self.cols, self.boxes = [0] * 9, [0] * 9, [0] * 9
        self.blanks = [i for i, v in enumerate(cells) if v == 0]
        self.consistent = True
        for i, v in enumerate(cells):
            if v:
                bit = 1 << (v - 1)
                r, c, b = _ROW[i], _COL[i], _BOX[i]
                if (self.rows[r] | self.cols[c] | self.boxes[b]) & bit:
                    self.consistent = False  # two equal givens share a unit
                self.rows[r] |= bit
                self.cols[c] |= bit
                self.boxes[b] |= bit

    def search(self, limit: int, rng: np.random.Generator | None = None) -> int:
        """Count solutions up to `limit`; leaves the first one found in self.solution."""
        self.solution: list[int] | None = None
        if not self.consistent:
            return 0
        rows, cols, boxes, cells, blanks = self.rows, self.cols, self.boxes, self.cells, self.blanks
        found = 0

        def recurse() -> bool:  # True = stop, limit reached
            nonlocal found
            if not blanks:
                found += 1
                if self.solution is None:
                    self.solution = list(cells)
                return found >= limit
            # Most-constrained blank first: keeps the tree narrow.
            best_k, best_free, best_n = 0, 0, 10
            for k, i in enumerate(blanks):
                free = _FULL & ~(rows[_ROW[i]] | cols[_COL[i]] | boxes[_BOX[i]])
                n = _POPCOUNT[free]
                if n < best_n:
                    best_k, best_free, best_n = k, free, n
                    if n <= 1:
                        break
            if best_n == 0:
                return False
            i = blanks[best_k]
            blanks[best_k] = blanks[-1]
            blanks.pop()
            r, c, b = _ROW[i], _COL[i], _BOX[i]
            options = _BITS[best_free]
            if rng is not None:
                options = [options[j] for j in rng.permutation(len(options))]
            stop = False
            for bit, digit in options:
                rows[r] |= bit
                cols[c] |= bit
                boxes[b] |= bit
                cells[i] = digit
                stop = recurse()
                rows[r] ^= bit
                cols[c] ^= bit
                boxes[b] ^= bit
                cells[i] = 0
                if stop:
                    break
            # Undo the swap-remove so the caller sees the same blank list.
            blanks.append(i)
            blanks[best_k], blanks[-1] = blanks[-1], blanks[best_k]
            return stop

        recurse()
        return found


def count_solutions(grid: np.ndarray, limit: int = 2) -> int:
    """Number of solutions of `grid`, counting stops at `limit` (so 2 means "not unique")."""
    return _Board(grid).search(limit)


def solve(grid: np.ndarray) -> np.ndarray | None:
    """One solution as a flat [81] int array, or None when there is none."""
    board = _Board(grid)
    board.search(1)
    return None if board.solution is None else np.array(board.solution, dtype=np.int64)


def is_valid_solution(grid: np.ndarray) -> bool:
    """True when every row, column and box holds 1..9 exactly once."""
    g = np.asarray(grid).reshape(9, 9)
    boxes = g.reshape(3, 3, 3, 3).transpose(0, 2, 1, 3).reshape(9, 9)
    want = np.arange(1, 10)
    return all(np.array_equal(np.sort(units, axis=1), np.broadcast_to(want, (9, 9))) for units in (g, g.T, boxes))


def random_solution(rng: np.random.Generator) -> np.ndarray:
    """A uniformly-seeded random full grid (randomized backtracking from empty)."""
    board = _Board(np.zeros(81, dtype=np.int64))
    board.search(1, rng=rng)
    assert board.solution is not None
    return np.array(board.solution, dtype=np.int64)


def generate_puzzle(rng: np.random.Generator, min_givens: int = DEFAULT_MIN_GIVENS) -> tuple[np.ndarray, np.ndarray]:
    """A puzzle with exactly one solution, and that solution.

    Cells of a random full grid are blanked in random order, each kept blank only
    if the puzzle stays unique, stopping once `min_givens` givens remain (the
    result may keep more when no further cell can go). Fewer givens = harder.
    """
    if not 17 <= min_givens <= 81:
        raise ValueError(f"min_givens must be in [17, 81], got {min_givens}")
    solution = random_solution(rng)
    puzzle = solution.copy()
    order = rng.permutation(81)
    budget = 81 - min_givens
    # Uniqueness is monotone (blanking more can only add solutions), so blanking a
    # whole chunk of the order and checking once accepts exactly what checking each
    # cell in turn would; on failure the chunk shrinks until a single cell is rejected.
    pos, chunk = 0, max(1, min(budget, 40))
    while budget > 0 and pos < 81:
        size = min(chunk, budget, 81 - pos)
        trial = puzzle.copy()
        trial[order[pos : pos + size]] = 0
        if count_solutions(trial, limit=2) == 1:
            puzzle, pos, budget = trial, pos + size, budget - size
        elif size == 1:
            pos += 1  # this cell must stay a given
            chunk = 4
        else:
            chunk = max(1, size // 2)
    return puzzle, solution


def augment(puzzle: np.ndarray, solution: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Apply one random validity-preserving symmetry to puzzle and solution alike.

    Digit relabelling (blank stays 0), optional transpose, shuffles of bands and
    stacks, and of rows/columns within each band/stack. Shapes are preserved.
    """
    digit_map = np.concatenate([[0], rng.permutation(9) + 1])
    row_perm = np.concatenate([band * 3 + rng.permutation(3) for band in rng.permutation(3)])
    col_perm = np.concatenate([stack * 3 + rng.permutation(3) for stack in rng.permutation(3)])
    # New cell (r, c) reads old cell (row_perm[r], col_perm[c]) of the (maybe transposed) grid.
    if rng.random() < 0.5:
        source = col_perm[None, :] * 9 + row_perm[:, None]
    else:
        source = row_perm[:, None] * 9 + col_perm[None, :]
    source = source.reshape(-1)

    def apply(grid: np.ndarray) -> np.ndarray:
        g = np.asarray(grid)
        return digit_map[g.reshape(-1)[source]].reshape(g.shape).astype(g.dtype, copy=False)

    return apply(puzzle), apply(solution)
