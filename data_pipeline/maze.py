"""Maze generator and breadth-first solver in the Maze-Hard character format.

A maze is a square 2-D uint8 array of ASCII codes over CHARSET "# SGo":
'#' wall, ' ' open floor, 'S' start, 'G' goal, 'o' a cell of the shortest
S -> G path (4-neighbour moves). A question holds '#', ' ', 'S', 'G'; its answer
is the same maze with the path cells strictly between S and G set to 'o'.
Tokens: '#'..'o' -> 1..5, pad 0 (vocab 6).
"""

from __future__ import annotations

from collections import deque

import numpy as np

CHARSET = "# SGo"
WALL, OPEN, START, GOAL, PATH = (ord(c) for c in CHARSET)
VOCAB_SIZE = len(CHARSET) + 1  # pad + charset
DEFAULT_SIZE = 30
DEFAULT_LOOP_FRACTION = 0.1

# ASCII code -> token id; 0 flags a character outside CHARSET.
CHAR_TO_TOKEN = np.zeros(256, dtype=np.uint8)
CHAR_TO_TOKEN[[ord(c) for c in CHARSET]] = np.arange(1, len(CHARSET) + 1)
TOKEN_TO_CHAR = np.array([ord("?")] + [ord(c) for c in CHARSET], dtype=np.uint8)

_STEPS = ((-1, 0), (1, 0), (0, -1), (0, 1))


def encode(grid: np.ndarray) -> np.ndarray:
    """ASCII grid(s) -> token ids (same shape, uint8); raises on characters outside CHARSET."""
    tokens = CHAR_TO_TOKEN[np.asarray(grid, dtype=np.uint8)]
    if np.any(tokens == 0):
        bad = sorted({chr(c) for c in np.asarray(grid)[tokens == 0].tolist()})
        raise ValueError(f"maze characters {bad} are not in {CHARSET!r}")
    return tokens


def decode(tokens: np.ndarray) -> np.ndarray:
    """Token ids -> ASCII grid(s); pad / unknown ids become '?'."""
    t = np.asarray(tokens)
    return TOKEN_TO_CHAR[np.where((t >= 1) & (t <= len(CHARSET)), t, 0)]


def to_string(grid: np.ndarray) -> str:
    """Row-major string of a maze (the CSV 'q' / 'a' format)."""
    return np.ascontiguousarray(grid, dtype=np.uint8).tobytes().decode("ascii")


def from_string(text: str) -> np.ndarray:
    """A square maze from its row-major string."""
    n = int(round(len(text) ** 0.5))
    if n * n != len(text) or n == 0:
        raise ValueError(f"a maze string must have a square length, got {len(text)}")
    return np.frombuffer(text.encode("ascii"), dtype=np.uint8).reshape(n, n).copy()


def _find(grid: np.ndarray, code: int, what: str) -> tuple[int, int]:
    cells = np.argwhere(grid == code)
    if len(cells) != 1:
        raise ValueError(f"a maze needs exactly one {what}, found {len(cells)}")
    return int(cells[0][0]), int(cells[0][1])


def bfs_distances(grid: np.ndarray, source: tuple[int, int]) -> np.ndarray:
    """Steps from `source` to every non-wall cell (-1 = unreachable or wall)."""
    h, w = grid.shape
    free = grid != WALL
    dist = np.full((h, w), -1, dtype=np.int64)
    dist[source] = 0
    queue = deque([source])
    while queue:
        r, c = queue.popleft()
        d = dist[r, c] + 1
        for dr, dc in _STEPS:
            nr, nc = r + dr, c + dc
            if 0 <= nr < h and 0 <= nc < w and free[nr, nc] and dist[nr, nc] < 0:
                dist[nr, nc] = d
                queue.append((nr, nc))
    return dist


def _shortest_paths(grid: np.ndarray) -> tuple[list[tuple[int, int]] | None, int]:
    """(one shortest S->G path as cells including S and G, number of shortest paths capped at 2)."""
    start, goal = _find(grid, START, "start 'S'"), _find(grid, GOAL, "goal 'G'")
    dist = bfs_distances(grid, start)
    if dist[goal] < 0:
        return None, 0
    h, w = grid.shape
    # Count shortest paths (capped) in order of distance: ways[v] = sum over predecessors.
    ways = np.zeros((h, w), dtype=np.int64)
    ways[start] = 1
    order = np.argwhere((dist > 0) & (dist <= dist[goal]))
    order = order[np.argsort(dist[order[:, 0], order[:, 1]], kind="stable")]
    for r, c in order:
        total = 0
        for dr, dc in _STEPS:
            pr, pc = r + dr, c + dc
            if 0 <= pr < h and 0 <= pc < w and dist[pr, pc] == dist[r, c] - 1:
                total += ways[pr, pc]
        ways[r, c] = min(total, 2)
    # Walk back from G through any predecessor.
    path = [goal]
    r, c = goal
    while (r, c) != start:
        for dr, dc in _STEPS:
            pr, pc = r + dr, c + dc
            if 0 <= pr < h and 0 <= pc < w and dist[pr, pc] == dist[r, c] - 1 and ways[pr, pc] > 0:
                r, c = pr, pc
                break
        path.append((r, c))
    return path[::-1], int(ways[goal])


def solve(question: np.ndarray) -> np.ndarray | None:
    """The answer grid (shortest path marked 'o'), or None when G cannot be reached.

    When several shortest paths exist one of them is marked; `count_shortest_paths`
    tells whether the answer is unique.
    """
    grid = np.asarray(question, dtype=np.uint8)
    path, _ = _shortest_paths(grid)
    if path is None:
        return None
    answer = grid.copy()
    for cell in path[1:-1]:
        answer[cell] = PATH
    return answer


def count_shortest_paths(question: np.ndarray) -> int:
    """Number of distinct shortest S->G paths, capped at 2 (0 = unreachable)."""
    return _shortest_paths(np.asarray(question, dtype=np.uint8))[1]


def _carve(rng: np.random.Generator, size: int, loop_fraction: float) -> np.ndarray:
    """Walls everywhere, then a random spanning tree of passages on a lattice of cells."""
    grid = np.full((size, size), WALL, dtype=np.uint8)
    # Lattice cells sit at odd offsets inside the border; an even size leaves one
    # spare row/column, put on a random side so mazes do not all hug one corner.
    m = (size - 1) // 2
    off_r = int(rng.integers(0, 2)) if size % 2 == 0 else 0
    off_c = int(rng.integers(0, 2)) if size % 2 == 0 else 0

    def pos(i: int, j: int) -> tuple[int, int]:
        return off_r + 1 + 2 * i, off_c + 1 + 2 * j

    seen = np.zeros((m, m), dtype=bool)
    start = (int(rng.integers(m)), int(rng.integers(m)))
    seen[start] = True
    grid[pos(*start)] = OPEN
    stack = [start]
    while stack:  # randomized depth-first search ("recursive backtracker")
        i, j = stack[-1]
        options = [(i + di, j + dj) for di, dj in _STEPS if 0 <= i + di < m and 0 <= j + dj < m and not seen[i + di, j + dj]]
        if not options:
            stack.pop()
            continue
        ni, nj = options[int(rng.integers(len(options)))]
        seen[ni, nj] = True
        (r0, c0), (r1, c1) = pos(i, j), pos(ni, nj)
        grid[r1, c1] = OPEN
        grid[(r0 + r1) // 2, (c0 + c1) // 2] = OPEN
        stack.append((ni, nj))

    if loop_fraction > 0:  # open some of the remaining inner walls between lattice cells
        walls = []
        for i in range(m):
            for j in range(m):
                for ni, nj in ((i + 1, j), (i, j + 1)):
                    if ni < m and nj < m:
                        (r0, c0), (r1, c1) = pos(i, j), pos(ni, nj)
                        wall = ((r0 + r1) // 2, (c0 + c1) // 2)
                        if grid[wall] == WALL:
                            walls.append(wall)
        k = int(round(loop_fraction * len(walls)))
        for idx in rng.choice(len(walls), size=k, replace=False) if k else ():
            grid[walls[idx]] = OPEN
    return grid


def generate_maze(
    rng: np.random.Generator,
    size: int = DEFAULT_SIZE,
    loop_fraction: float = DEFAULT_LOOP_FRACTION,
    min_path_length: int | None = None,
    max_tries: int = 100,
) -> tuple[np.ndarray, np.ndarray]:
    """(question, answer) ASCII grids of a random maze whose shortest S->G path is unique.

    loop_fraction: share of the spanning tree's leftover inner walls knocked down
    (0 = a perfect maze with exactly one route). min_path_length: fewest steps
    from S to G; by default G is drawn from the farthest quarter of the cells
    reachable from S, which gives long ("hard") paths.
    """
    if size < 5:
        raise ValueError(f"maze size must be >= 5, got {size}")
    if not 0.0 <= loop_fraction <= 1.0:
        raise ValueError(f"loop_fraction must be in [0, 1], got {loop_fraction}")
    for _ in range(max_tries):
        grid = _carve(rng, size, loop_fraction)
        free = np.argwhere(grid == OPEN)
        start = tuple(int(x) for x in free[rng.integers(len(free))])
        dist = bfs_distances(grid, start)
        if min_path_length is None:
            cutoff = np.quantile(dist[dist > 0], 0.75)
            candidates = np.argwhere(dist >= max(cutoff, 2))
        else:
            candidates = np.argwhere(dist >= min_path_length)
        if len(candidates) == 0:
            continue
        goal = tuple(int(x) for x in candidates[rng.integers(len(candidates))])
        question = grid.copy()
        question[start], question[goal] = START, GOAL
        path, count = _shortest_paths(question)
        if count != 1:
            continue  # loops made two equally short routes: the label would be ambiguous
        answer = question.copy()
        for cell in path[1:-1]:
            answer[cell] = PATH
        return question, answer
    raise RuntimeError(f"no maze with a unique shortest path in {max_tries} tries; lower loop_fraction/min_path_length")


def path_length(answer: np.ndarray) -> int:
    """Steps from S to G along the marked path ('o' cells + 1)."""
    return int(np.sum(np.asarray(answer) == PATH)) + 1
