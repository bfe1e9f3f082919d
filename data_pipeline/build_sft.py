"""Build tokenized SFT splits ("train", "test") from JSONL, in the data_pipeline.sft_format layout.

    python -m data_pipeline.build_sft --jsonl train.jsonl --eval-jsonl test.jsonl \\
        --tokenizer gs://bucket/gemma/tokenizer.model --seq-len 256 --packing --output-dir data/sft
    python -m data_pipeline.build_sft --generate-arithmetic 2000 --seq-len 128 --output-dir data/arith

Records: {"prompt", "reasoning", "answer"} or {"messages": [...], "answer"?} (data_pipeline.sft).
Without --eval-jsonl, --eval-fraction (default 0.1) of the examples is held out as "test".

Truncation: an example whose prompt (everything up to and including the last
`<start_of_turn>model\\n`) leaves no room for one response token within seq_len is dropped;
a longer response is cut at seq_len (its closing `<end_of_turn>` is then lost). Both are
counted in sft.json (num_dropped, num_truncated) and reported.
Packing (--packing, train only; the test split is never packed, so it keeps its prompts for
generation): best-fit-decreasing into rows of seq_len, each example its own segment.
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
from dataclasses import dataclass

import fsspec
import numpy as np
from tqdm import tqdm

from data_pipeline.arithmetic import generate_records
from data_pipeline.marker import claim, finish
from data_pipeline.puzzle_format import DatasetError, builder_cli
from data_pipeline.sft import (
    format_response,
    prompt_length,
    read_jsonl,
    render_messages,
)
from data_pipeline.sft_format import SFTMetadata, load_sft_metadata, write_sft_split
from data_pipeline.tokenizer import Tokenizer, train_tokenizer
from runtime.ranges import Rule, at_least, check_args
from runtime.task import IGNORE_LABEL

BUILDER = "build_sft"  # the name in the marker of the folders it builds (data_pipeline/marker.py)
DEFAULT_VOCAB_SIZE = 512  # of the tokenizer trained for a generated arithmetic set
# Its smallest: the tokenizer's 262 fixed pieces and every character the problems use (55: digits,
# operators, the templates' letters); SentencePiece refuses fewer, after the build has begun.
MIN_GENERATED_VOCAB = 262 + 55


@dataclass
class Encoded:
    """Examples of one split after the truncation policy: tokens[i] has at most seq_len + 1 ids."""
    tokens: list[np.ndarray]
    masks: list[np.ndarray]
    prompt_lengths: list[int]
    answers: list[str]
    num_truncated: int = 0
    num_dropped: int = 0


def encode_examples(tokenizer: Tokenizer, examples, seq_len: int, desc: str) -> Encoded:
    out = Encoded([], [], [], [])
    for messages, answer in tqdm(examples, desc=desc, unit="ex"):
        tokens, mask = render_messages(tokenizer, messages)
        plen = prompt_length(mask)
        if plen > seq_len:  # inputs are tokens[:-1]: the first response target needs position plen - 1
            out.num_dropped += 1
            continue
        if len(tokens) > seq_len + 1:
            tokens, mask = tokens[:seq_len + 1], mask[:seq_len + 1]
            out.num_truncated += 1
        out.tokens.append(np.asarray(tokens, np.int32))
        out.masks.append(np.asarray(mask, bool))
        out.prompt_lengths.append(plen)
        out.answers.append(answer)
    return out


def _shifted(tokens: np.ndarray, mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(inputs, labels) of one example: labels[t] is the next token where it is a target."""
    return tokens[:-1], np.where(mask[1:], tokens[1:], IGNORE_LABEL).astype(np.int32)


def unpacked_arrays(enc: Encoded, seq_len: int, pad_id: int) -> dict[str, np.ndarray]:
    n = len(enc.tokens)
    inputs = np.full((n, seq_len), pad_id, np.int32)
    labels = np.full((n, seq_len), IGNORE_LABEL, np.int32)
    for i, (tokens, mask) in enumerate(zip(enc.tokens, enc.masks)):
        x, y = _shifted(tokens, mask)
        inputs[i, :len(x)], labels[i, :len(y)] = x, y
    return {"inputs": inputs, "labels": labels, "prompt_lengths": np.asarray(enc.prompt_lengths, np.int32)}


def pack_rows(lengths: list[int], capacity: int) -> list[list[int]]:
    """Best-fit decreasing: example indices per row, each row's lengths summing to <= capacity."""
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (room left, row), sorted
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):  # stable: ties keep file order
        k = bisect.bisect_left(free, (lengths[i], -1))
        if k == len(free):
            rows.append([i])
            room, r = capacity - lengths[i], len(rows) - 1
        else:
            room, r = free.pop(k)
            rows[r].append(i)
            room -= lengths[i]
        if room > 0:
            bisect.insort(free, (room, r))
    return rows


def packed_arrays(enc: Encoded, seq_len: int, pad_id: int) -> dict[str, np.ndarray]:
    rows = pack_rows([len(t) - 1 for t in enc.tokens], seq_len)
    shape = (len(rows), seq_len)
    out = {"inputs": np.full(shape, pad_id, np.int32), "labels": np.full(shape, IGNORE_LABEL, np.int32),
           "segment_ids": np.zeros(shape, np.int32), "positions": np.zeros(shape, np.int32)}
    for r, members in enumerate(tqdm(rows, desc="packing", unit="row")):
        at = 0
        for seg, i in enumerate(members, 1):
            x, y = _shifted(enc.tokens[i], enc.masks[i])
            span = slice(at, at + len(x))
            out["inputs"][r, span], out["labels"][r, span] = x, y
            out["segment_ids"][r, span], out["positions"][r, span] = seg, np.arange(len(x))
            at += len(x)
    return out


def _write(output_dir: str, split: str, enc: Encoded, tokenizer: Tokenizer, seq_len: int, packed: bool,
           source: str) -> SFTMetadata:
    if not enc.tokens:
        raise DatasetError(f"the {split} split of {source} has no example that fits seq_len={seq_len} "
                           f"({enc.num_dropped} prompts too long); raise --seq-len or shorten the prompts")
    arrays = (packed_arrays if packed else unpacked_arrays)(enc, seq_len, tokenizer.pad_id)
    metadata = SFTMetadata(
        vocab_size=tokenizer.vocab_size, seq_len=seq_len, pad_id=tokenizer.pad_id, eos_id=tokenizer.eos_id,
        end_of_turn_id=tokenizer.end_of_turn_id, packed=packed, num_rows=len(arrays["inputs"]),
        num_examples=len(enc.tokens), num_truncated=enc.num_truncated, num_dropped=enc.num_dropped,
        tokenizer=tokenizer.path, source=source)
    write_sft_split(output_dir, split, arrays, metadata, None if packed else enc.answers)
    return metadata


def build_sft_dataset(output_dir: str | os.PathLike, jsonl: str, tokenizer: str | Tokenizer, seq_len: int, *,
                      eval_jsonl: str | None = None, eval_fraction: float = 0.1, packing: bool = False,
                      seed: int = 0, rebuild: bool = False) -> dict[str, SFTMetadata]:
    """Write <output_dir>/train and <output_dir>/test (local or gs://); returns their metadata.

    The test split is eval_jsonl, or eval_fraction of jsonl held out (chosen by seed).
    packing applies to train only. rebuild: replace an earlier build in output_dir made
    with other parameters (else refused). Raises DatasetError / TokenizerError (one line).
    """
    if seq_len < 2:
        raise ValueError(f"seq_len must be >= 2, got {seq_len}")
    tokenizer_path = getattr(tokenizer, "path", tokenizer)
    claim(str(output_dir), BUILDER, {"jsonl": (jsonl, "--jsonl"), "tokenizer": (tokenizer_path, "--tokenizer"),
                                     "seq_len": (seq_len, "--seq-len"), "eval_jsonl": (eval_jsonl, "--eval-jsonl"),
                                     "eval_fraction": (eval_fraction, "--eval-fraction"),
                                     "packing": (packing, "--packing"), "seed": (seed, "--seed")},
          inputs=[jsonl, eval_jsonl, tokenizer_path], rebuild=rebuild)
    out = _build_splits(output_dir, jsonl, tokenizer, seq_len, eval_jsonl=eval_jsonl, eval_fraction=eval_fraction,
                        packing=packing, seed=seed)
    finish(str(output_dir))
    return out


def _build_splits(output_dir: str | os.PathLike, jsonl: str, tokenizer: str | Tokenizer, seq_len: int, *,
                  eval_jsonl: str | None, eval_fraction: float, packing: bool, seed: int) -> dict[str, SFTMetadata]:
    tok = tokenizer if isinstance(tokenizer, Tokenizer) else Tokenizer(tokenizer)
    examples = read_jsonl(jsonl)
    sources = {"train": jsonl, "test": eval_jsonl}
    if eval_jsonl is not None:
        splits = {"train": examples, "test": read_jsonl(eval_jsonl)}
    else:
        if not 0 < eval_fraction < 1:
            raise ValueError(f"eval_fraction must be in (0, 1), got {eval_fraction}")
        n_eval = max(1, round(len(examples) * eval_fraction))
        if len(examples) - n_eval < 1:
            raise DatasetError(f"{jsonl} has {len(examples)} examples: too few to hold out a test split; "
                               "add examples or pass --eval-jsonl")
        held = set(np.random.default_rng(seed).permutation(len(examples))[:n_eval].tolist())
        splits = {"train": [e for i, e in enumerate(examples) if i not in held],
                  "test": [e for i, e in enumerate(examples) if i in held]}
        sources["test"] = f"{jsonl} (held out: eval_fraction={eval_fraction}, seed={seed})"
    out = {}
    for split, exs in splits.items():
        enc = encode_examples(tok, exs, seq_len, desc=f"tokenizing {split}")
        out[split] = _write(str(output_dir), split, enc, tok, seq_len, packing and split == "train", sources[split])
    return out


def build_generated_arithmetic(output_dir: str | os.PathLike, num_train: int, num_eval: int, seq_len: int,
                               seed: int, vocab_size: int = DEFAULT_VOCAB_SIZE, *, tokenizer: str | None = None,
                               packing: bool = False, rebuild: bool = False) -> None:
    """Synthetic arithmetic reasoning set (data_pipeline.arithmetic): writes train.jsonl, test.jsonl,
    tokenizer.model (trained on the problems unless `tokenizer` is given) and the train/test splits
    into output_dir (local). Deterministic in seed. rebuild: as build_sft_dataset's."""
    if num_train < 1 or num_eval < 1:
        raise ValueError(f"need num_train >= 1 and num_eval >= 1, got {num_train}, {num_eval}")
    root = str(output_dir).rstrip("/")
    claim(root, BUILDER, {"generate_arithmetic": (num_train + num_eval, "--generate-arithmetic"),
                          "num_eval": (num_eval, "--eval-fraction"), "seq_len": (seq_len, "--seq-len"),
                          "seed": (seed, "--seed"), "vocab_size": (vocab_size, "--vocab-size"),
                          "tokenizer": (tokenizer, "--tokenizer"), "packing": (packing, "--packing")},
          inputs=[tokenizer], rebuild=rebuild)
    records = generate_records(num_train + num_eval, seed)
    paths = {"train": f"{root}/train.jsonl", "test": f"{root}/test.jsonl"}
    for split, part in (("train", records[:num_train]), ("test", records[num_train:])):
        with fsspec.open(paths[split], "w", encoding="utf-8") as f:
            f.writelines(_json_line(r) for r in part)
    if tokenizer is None:
        texts = [t for r in records for t in (f"user\n{r['prompt']}", f"model\n{format_response(r['reasoning'], r['answer'])}")]
        tokenizer = train_tokenizer(texts, f"{root}/tokenizer.model", vocab_size)
    _build_splits(root, paths["train"], tokenizer, seq_len, eval_jsonl=paths["test"], eval_fraction=0.1, packing=packing,
                  seed=seed)
    finish(root)


def _json_line(record: dict) -> str:
    return json.dumps(record, ensure_ascii=False) + "\n"


# Ranges of the command line's numbers (as runtime/config.py's _RULES for a run's settings).
_RULES: dict[str, Rule] = {
    "--generate-arithmetic": (at_least(2), "at least one train and one test problem"),
    "--eval-fraction": ((lambda v: 0 < v < 1, "in (0, 1)"), "the share held out as the test split"),
    "--vocab-size": (at_least(MIN_GENERATED_VOCAB), "the tokenizer's 262 fixed pieces and the problems' 55 characters"),
    "--seq-len": (at_least(2), ""),
    "--seed": (at_least(0), ""),
}


@builder_cli
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output-dir", required=True, help="dataset root (local or gs://)")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--jsonl", help="training records (local or gs://)")
    source.add_argument("--generate-arithmetic", type=int, metavar="N", help="generate N arithmetic problems instead")
    held = parser.add_mutually_exclusive_group()
    held.add_argument("--eval-jsonl", help="test records (default: hold out --eval-fraction of the training ones)")
    held.add_argument("--eval-fraction", type=float, default=0.1, help="fraction held out as test (default 0.1)")
    parser.add_argument("--tokenizer", help="SentencePiece tokenizer.model (local or gs://); "
                                            "with --generate-arithmetic, default: train a small one")
    parser.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE,
                        help="vocab of the tokenizer trained for --generate-arithmetic")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--packing", action="store_true", help="pack several examples per train row")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rebuild", action="store_true", help="replace a set built in --output-dir with other options")
    args = parser.parse_args(argv)
    check_args(args, _RULES, DatasetError)
    if args.jsonl and not args.tokenizer:
        parser.error("--jsonl needs --tokenizer (the model's SentencePiece tokenizer.model)")
    if args.generate_arithmetic is not None and args.eval_jsonl:
        parser.error("--eval-jsonl goes with --jsonl; --generate-arithmetic holds out --eval-fraction")
    if args.generate_arithmetic is not None:  # DatasetError / TokenizerError: builder_cli's one line
        n_eval = max(1, round(args.generate_arithmetic * args.eval_fraction))
        build_generated_arithmetic(args.output_dir, args.generate_arithmetic - n_eval, n_eval, args.seq_len,
                                   args.seed, args.vocab_size, tokenizer=args.tokenizer, packing=args.packing,
                                   rebuild=args.rebuild)
    else:
        build_sft_dataset(args.output_dir, args.jsonl, args.tokenizer, args.seq_len, eval_jsonl=args.eval_jsonl,
                          eval_fraction=args.eval_fraction, packing=args.packing, seed=args.seed, rebuild=args.rebuild)
    for split in ("train", "test"):
        m = load_sft_metadata(args.output_dir, split)
        print(f"{split}: {m.num_examples} examples in {m.num_rows} rows of {m.seq_len} "
              f"({m.num_truncated} truncated, {m.num_dropped} dropped){' packed' if m.packed else ''}")
    print(f"wrote {args.output_dir}")


if __name__ == "__main__":
    main()
