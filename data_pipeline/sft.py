"""Gemma chat format for supervised fine-tuning, the "show your work" response format,
its scoring, and the JSONL records the SFT builder reads.

Template (Gemma has no system role)::

    <bos><start_of_turn>user\\n{prompt}<end_of_turn>\\n<start_of_turn>model\\n{response}<end_of_turn>

Multi-turn conversations repeat `\\n<start_of_turn>{role}\\n{content}<end_of_turn>`. A system
message (allowed only as the first message) is prepended to the first user turn, separated by
a blank line, as Gemma's own chat template does. Loss falls on every model turn: its content
and its closing `<end_of_turn>` (so the model learns to stop); never on the role headers.

Each text piece is encoded on its own and the special ids are spliced in, so neither user
nor model text can produce a turn marker (see Tokenizer.encode).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

import fsspec

from data_pipeline.puzzle_format import DatasetError
from data_pipeline.tokenizer import Tokenizer

ROLES = {"user": "user", "model": "model", "assistant": "model"}
ACCEPTED = ('accepted records: {"prompt": str, "reasoning": str, "answer": str} or '
            '{"messages": [{"role": "system"|"user"|"model"|"assistant", "content": str}, ...], "answer"?: str}')

Message = dict[str, str]


def format_response(reasoning: str, answer: str) -> str:
    return f"<reasoning>{reasoning}</reasoning><answer>{answer}</answer>"


_BLOCK = {tag: re.compile(f"<{tag}>(.*?)</{tag}>", re.DOTALL) for tag in ("reasoning", "answer")}
_WELL_FORMED = re.compile(r"\s*<reasoning>(.*?)</reasoning>\s*<answer>(.*?)</answer>\s*", re.DOTALL)
_TAGS = ("<reasoning>", "</reasoning>", "<answer>", "</answer>")


def parse_response(text: str) -> tuple[str | None, str | None, bool]:
    """(reasoning, answer, well_formed). A block's content is returned only when the text has
    exactly one such block (several answers count as no answer, so hedging cannot score).
    Well-formed: exactly one reasoning block then exactly one answer block, with nothing but
    whitespace before, between and after."""
    found = {tag: rx.findall(text) for tag, rx in _BLOCK.items()}
    reasoning = found["reasoning"][0] if len(found["reasoning"]) == 1 else None
    answer = found["answer"][0] if len(found["answer"]) == 1 else None
    well_formed = (_WELL_FORMED.fullmatch(text) is not None and all(text.count(t) == 1 for t in _TAGS))
    return reasoning, answer, well_formed


def score(responses: Sequence[str], answers: Sequence[str]) -> dict[str, float]:
    """Fractions of responses whose parsed answer equals the reference (both stripped) and
    of well-formed responses. Empty input scores 0."""
    if len(responses) != len(answers):
        raise ValueError(f"{len(responses)} responses for {len(answers)} reference answers")
    exact = formatted = 0
    for text, ref in zip(responses, answers):
        _, answer, well_formed = parse_response(text)
        exact += answer is not None and answer.strip() == str(ref).strip()
        formatted += well_formed
    n = max(len(responses), 1)
    return {"answer_exact_match": exact / n, "format_adherence": formatted / n}


def _normalise(messages: Sequence[Message]) -> list[tuple[str, str]]:
    """(role, content) with roles user|model and the system message folded into the first
    user turn. Raises ValueError naming the problem."""
    turns = [(m["role"], m["content"]) for m in messages]
    system = None
    if turns and turns[0][0] == "system":
        system, turns = turns[0][1], turns[1:]
    out = []
    for role, content in turns:
        if role not in ROLES:
            raise ValueError(f"role {role!r} (a system message may only come first; roles: system, user, model, assistant)")
        out.append((ROLES[role], content))
    if not out or out[0][0] != "user":
        raise ValueError("the conversation must start with a user turn (after an optional system message)")
    if out[-1][0] != "model":
        raise ValueError("the conversation must end with a model turn (the response to learn and score)")
    if system is not None:
        out[0] = ("user", f"{system}\n\n{out[0][1]}")
    return out


def render_messages(tokenizer: Tokenizer, messages: Sequence[Message]) -> tuple[list[int], list[int]]:
    """(tokens, loss_mask) of a conversation; loss_mask[i] = 1 where token i is a target."""
    tokens, mask = [tokenizer.bos_id], [0]

    def add(ids: list[int], on: int) -> None:
        tokens.extend(ids)
        mask.extend([on] * len(ids))

    for i, (role, content) in enumerate(_normalise(messages)):
        if i:
            add(tokenizer.encode("\n"), 0)
        add([tokenizer.start_of_turn_id], 0)
        add(tokenizer.encode(f"{role}\n"), 0)
        on = int(role == "model")
        add(tokenizer.encode(content), on)
        add([tokenizer.end_of_turn_id], on)
    return tokens, mask


def render_chat(tokenizer: Tokenizer, prompt: str, response: str) -> tuple[list[int], list[int]]:
    """(tokens, loss_mask) of one user prompt and one model response."""
    return render_messages(tokenizer, [{"role": "user", "content": prompt}, {"role": "model", "content": response}])


def render_prompt(tokenizer: Tokenizer, prompt: str) -> list[int]:
    """The tokens a model continues from to answer `prompt` (ends with `<start_of_turn>model\\n`)."""
    tokens, mask = render_chat(tokenizer, prompt, "")
    return tokens[:prompt_length(mask)]


def prompt_length(loss_mask: Sequence[int]) -> int:
    """Tokens before the last model turn's content: the prompt up to and including its
    `<start_of_turn>model\\n` header (where generation starts)."""
    n = len(loss_mask)
    while n and loss_mask[n - 1]:
        n -= 1
    if n == len(loss_mask):
        raise ValueError("loss mask has no model turn")
    return n


def _record_to_messages(record: Any) -> tuple[list[Message], str]:
    """(messages, reference answer) from one JSONL record; ValueError naming the problem."""
    if not isinstance(record, dict):
        raise ValueError(f"expected a JSON object, got {type(record).__name__}")
    if "messages" in record:
        if any(k in record for k in ("prompt", "reasoning")):
            raise ValueError('a record holds either "messages" or "prompt"/"reasoning", not both')
        msgs = record["messages"]
        if not isinstance(msgs, list) or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in msgs):
            raise ValueError('"messages" must be a list of {"role": str, "content": str}')
        messages = [{"role": m["role"], "content": m["content"]} for m in msgs]
        last = _normalise(messages)[-1][1]  # validates; the last turn is the model's
        if "answer" in record:
            answer = _text(record, "answer")
        else:  # score against the last model turn: its answer block, or all of it
            parsed = parse_response(last)[1]
            answer = (parsed if parsed is not None else last).strip()
        return messages, answer
    missing = [k for k in ("prompt", "reasoning", "answer") if k not in record]
    if missing:
        raise ValueError(f"missing keys {missing}")
    prompt, reasoning, answer = (_text(record, k) for k in ("prompt", "reasoning", "answer"))
    return [{"role": "user", "content": prompt}, {"role": "model", "content": format_response(reasoning, answer)}], answer


def _text(record: dict, key: str) -> str:
    value = record[key]
    if key == "answer" and isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)  # JSON numbers are fine as answers
    if not isinstance(value, str):
        raise ValueError(f'"{key}" must be a string, got {type(value).__name__}')
    return value


def read_jsonl(path: str) -> list[tuple[list[Message], str]]:
    """(messages, reference answer) per non-blank line of a JSONL file (local or gs://).
    Extra keys (ids, sources) are ignored. DatasetError names the file, line and accepted shapes."""
    out = []
    try:
        with fsspec.open(path, "rt", encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    out.append(_record_to_messages(json.loads(line)))
                except (ValueError, TypeError) as e:  # JSONDecodeError is a ValueError
                    raise DatasetError(f"{path} line {lineno}: {' '.join(str(e).split())}; {ACCEPTED}") from None
    except FileNotFoundError:
        raise DatasetError(f"JSONL file not found: {path}; pass an existing local path or gs:// URL") from None
    except UnicodeDecodeError as e:
        raise DatasetError(f"{path}: not UTF-8 text ({e}); write the JSONL as UTF-8") from None
    return out
