"""Synthetic arithmetic problems with step-by-step reasoning (the CPU demo's SFT data).

An expression is a chain of terms joined by + and -, where a term is a number or a product
or exact quotient of two numbers; 2-3 operators in all. The reasoning evaluates the products
and quotients first, then the chain left to right, one operator per step::

    prompt    "Compute 23 + 58 * 4 - 7."
    reasoning "58 * 4 = 232. 23 + 232 = 255. 255 - 7 = 248."
    answer    "248"

Some problems are phrased as word problems over the same expressions. Deterministic in seed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

Term = int | tuple[int, str, int]  # a number, or (a, "*" | "/", b)

_EXPRESSION_TEMPLATES = ("Compute {e}.", "What is {e}?", "Evaluate {e}.", "Calculate {e} step by step.")
_NAMES = ("Ava", "Ben", "Chloe", "Dan", "Ema", "Finn", "Gus", "Hana")


@dataclass(frozen=True)
class Problem:
    expression: str
    prompt: str
    reasoning: str
    answer: str

    def record(self) -> dict[str, str]:
        return {"prompt": self.prompt, "reasoning": self.reasoning, "answer": self.answer}


def _apply(a: int, op: str, b: int) -> int:
    if op == "/":
        assert a % b == 0, (a, b)  # generated quotients are exact
        return a // b
    return {"+": a + b, "-": a - b, "*": a * b}[op]


def solve(terms: list[Term], signs: list[str]) -> tuple[str, str, int]:
    """(expression, reasoning, value) of terms[0] signs[0] terms[1] ..."""
    text = [t if isinstance(t, int) else f"{t[0]} {t[1]} {t[2]}" for t in terms]
    expression = " ".join([str(text[0])] + [f"{s} {t}" for s, t in zip(signs, text[1:])])
    steps, values = [], []
    for t in terms:
        if isinstance(t, int):
            values.append(t)
        else:
            values.append(_apply(*t))
            steps.append(f"{t[0]} {t[1]} {t[2]} = {values[-1]}.")
    value = values[0]
    for sign, v in zip(signs, values[1:]):
        new = _apply(value, sign, v)
        steps.append(f"{value} {sign} {v} = {new}.")
        value = new
    return expression, " ".join(steps), value


def _compound(rng: np.random.Generator) -> tuple[int, str, int]:
    if rng.random() < 0.6:
        return int(rng.integers(2, 21)), "*", int(rng.integers(2, 13))
    divisor = int(rng.integers(2, 13))
    return divisor * int(rng.integers(2, 21)), "/", divisor


def _expression_problem(rng: np.random.Generator) -> Problem:
    num_ops = int(rng.integers(2, 4))
    num_compound = int(rng.integers(0, (num_ops + 1) // 2 + 1))  # leaves at least two terms
    num_terms = num_ops - num_compound + 1
    compound_at = set(rng.choice(num_terms, size=num_compound, replace=False).tolist())
    terms: list[Term] = [_compound(rng) if i in compound_at else int(rng.integers(1, 100)) for i in range(num_terms)]
    signs = [str(rng.choice(["+", "-"])) for _ in range(num_terms - 1)]
    expression, reasoning, value = solve(terms, signs)
    template = _EXPRESSION_TEMPLATES[int(rng.integers(len(_EXPRESSION_TEMPLATES)))]
    return Problem(expression, template.format(e=expression), reasoning, str(value))


def _word_problem(rng: np.random.Generator) -> Problem:
    name = _NAMES[int(rng.integers(len(_NAMES)))]
    kind = int(rng.integers(3))
    if kind == 0:  # a + b * c - d, never negative
        a, b, c = (int(rng.integers(lo, hi)) for lo, hi in ((1, 60), (2, 10), (2, 13)))
        d = int(rng.integers(1, a + b * c + 1))
        terms, signs = [a, (b, "*", c), d], ["+", "-"]
        prompt = (f"{name} has {a} marbles, buys {b} bags of {c} marbles each, then gives away {d}. "
                  f"How many marbles does {name} have now?")
    elif kind == 1:  # a - b * c + d with a >= b * c
        b, c = int(rng.integers(2, 10)), int(rng.integers(2, 13))
        a, d = b * c + int(rng.integers(0, 50)), int(rng.integers(1, 40))
        terms, signs = [a, (b, "*", c), d], ["-", "+"]
        prompt = (f"A shop has {a} pens. It sells {b} packs of {c} pens, then receives a delivery of {d} pens. "
                  "How many pens does the shop have?")
    else:  # a / b + c
        b = int(rng.integers(2, 10))
        a, c = b * int(rng.integers(2, 15)), int(rng.integers(1, 20))
        terms, signs = [(a, "/", b), c], ["+"]
        prompt = (f"{name} shares {a} cookies equally among {b} friends. Each friend then gets {c} more cookies. "
                  "How many cookies does each friend have?")
    expression, reasoning, value = solve(terms, signs)
    return Problem(expression, prompt, reasoning, str(value))


def generate_problems(n: int, seed: int) -> list[Problem]:
    """n problems with distinct prompts (so held-out ones never appear in training)."""
    rng = np.random.default_rng(seed)
    seen: set[str] = set()
    out: list[Problem] = []
    while len(out) < n:
        problem = _word_problem(rng) if rng.random() < 0.25 else _expression_problem(rng)
        if problem.prompt not in seen:
            seen.add(problem.prompt)
            out.append(problem)
    return out


def generate_records(n: int, seed: int) -> list[dict[str, str]]:
    """n {"prompt", "reasoning", "answer"} records (the JSONL shape data_pipeline.sft reads)."""
    return [p.record() for p in generate_problems(n, seed)]
