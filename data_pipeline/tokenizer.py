"""SentencePiece tokenizer with Gemma's conventions, loaded from a local path or gs://.

Gemma: pad 0, eos 1, bos 2, unk 3; `<start_of_turn>` / `<end_of_turn>` are ordinary
(user-defined) pieces whose ids differ between Gemma 1/2 and Gemma 3, so they are looked up
by piece, never hard-coded. `train_tokenizer` makes a tiny model with the same conventions
for tests and the CPU demo (the real Gemma tokenizer is not reachable offline).
"""

from __future__ import annotations

import io
import os
import re
from collections.abc import Iterable

import fsspec
import sentencepiece as spm

START_OF_TURN = "<start_of_turn>"
END_OF_TURN = "<end_of_turn>"
_FIX = ("pass the path of a SentencePiece tokenizer.model (Gemma's ships beside its checkpoint; "
        "local path or gs://), or train a small one with data_pipeline.tokenizer.train_tokenizer")


class TokenizerError(ValueError):
    """The tokenizer model is missing, unreadable or unsuitable; one line naming path and fix."""


def _read_bytes(path: str) -> bytes:
    try:
        with fsspec.open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        raise TokenizerError(f"tokenizer model not found at {path}; {_FIX}") from None
    except Exception as e:  # permissions, bad URL, storage errors: all mean "cannot read it"
        raise TokenizerError(f"cannot read tokenizer model {path} ({' '.join(str(e).split())}); {_FIX}") from e


class Tokenizer:
    """encode/decode plus the special ids. `encode` never produces the turn (or bos/eos/pad)
    ids from text: a literal "<end_of_turn>" in user text is encoded as ordinary characters,
    so only the chat template (data_pipeline.sft) can place turn boundaries."""

    def __init__(self, path: str | os.PathLike):
        self.path = str(path)
        proto = _read_bytes(self.path)
        try:
            self._sp = spm.SentencePieceProcessor(model_proto=proto)
        except (RuntimeError, TypeError, OSError) as e:
            raise TokenizerError(f"{self.path} is not a SentencePiece model ({' '.join(str(e).split())}); {_FIX}") from e
        sp = self._sp
        self.vocab_size = int(sp.get_piece_size())
        self.pad_id, self.eos_id, self.bos_id, self.unk_id = sp.pad_id(), sp.eos_id(), sp.bos_id(), sp.unk_id()
        for name in ("pad", "eos", "bos"):
            if getattr(self, f"{name}_id") < 0:
                raise TokenizerError(f"tokenizer model {self.path} defines no {name} id; use a Gemma tokenizer "
                                     "or one trained with data_pipeline.tokenizer.train_tokenizer")
        self.start_of_turn_id = self._piece_id(START_OF_TURN)
        self.end_of_turn_id = self._piece_id(END_OF_TURN)
        # Special strings that plain encoding would turn into their special id (user-defined
        # pieces): encode() breaks them up. Control pieces (Gemma's bos/eos/pad) never match text.
        specials = {sp.id_to_piece(i) for i in (self.start_of_turn_id, self.end_of_turn_id, self.bos_id,
                                                 self.eos_id, self.pad_id)}
        protected = sorted((s for s in specials if sp.encode(s) == [sp.piece_to_id(s)]), key=len, reverse=True)
        self._protected = re.compile("|".join(map(re.escape, protected))) if protected else None

    def _piece_id(self, piece: str) -> int:
        i = self._sp.piece_to_id(piece)
        if i == self.unk_id or self._sp.id_to_piece(i) != piece:
            raise TokenizerError(f"tokenizer model {self.path} has no '{piece}' piece, so the Gemma chat template "
                                 "cannot be rendered; use a Gemma (1/2/3) tokenizer.model or one trained with "
                                 "data_pipeline.tokenizer.train_tokenizer")
        return int(i)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, without bos/eos."""
        if self._protected is None or not self._protected.search(text):
            return list(self._sp.encode(text))
        # Encode the first character of each special string apart from the rest: the text
        # round-trips, the special id cannot appear. Exact for models without a dummy prefix
        # (Gemma's and train_tokenizer's); others would gain a space at each split.
        ids: list[int] = []
        pos = 0
        for m in self._protected.finditer(text):
            for part in (text[pos:m.start()], m.group()[:1], m.group()[1:]):
                if part:
                    ids.extend(self._sp.encode(part))
            pos = m.end()
        if pos < len(text):
            ids.extend(self._sp.encode(text[pos:]))
        return ids

    def decode(self, ids: Iterable[int]) -> str:
        return self._sp.decode([int(i) for i in ids])

    def id_to_piece(self, i: int) -> str:
        return self._sp.id_to_piece(int(i))

    def __repr__(self) -> str:
        return f"Tokenizer({self.path!r}, vocab_size={self.vocab_size})"


def train_tokenizer(texts: Iterable[str], out_path: str | os.PathLike, vocab_size: int) -> str:
    """Train a small BPE SentencePiece model with Gemma's conventions and write it to out_path
    (local or gs://); returns out_path. Deterministic for the same texts (one thread, no sampling).

    pad 0, eos 1, bos 2, unk 3, then `<start_of_turn>` and `<end_of_turn>` as user-defined
    pieces; byte fallback (no unknown characters); identity normalisation, no dummy prefix
    and digits split one per token, as in Gemma. vocab_size is an upper bound (a tiny corpus
    may yield fewer pieces); it must leave room for the 262 fixed pieces (6 special + 256 bytes).
    """
    if vocab_size < 300:
        raise ValueError(f"vocab_size={vocab_size} is too small: byte fallback alone needs 262 pieces; use >= 300")
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(list(texts)), model_writer=buf, model_type="bpe", vocab_size=vocab_size,
        pad_id=0, eos_id=1, bos_id=2, unk_id=3, pad_piece="<pad>", eos_piece="<eos>", bos_piece="<bos>",
        unk_piece="<unk>", user_defined_symbols=[START_OF_TURN, END_OF_TURN], byte_fallback=True,
        normalization_rule_name="identity", add_dummy_prefix=False, remove_extra_whitespaces=False,
        split_digits=True, allow_whitespace_only_pieces=True, character_coverage=1.0, hard_vocab_limit=False,
        max_sentence_length=1 << 20, shuffle_input_sentence=False, num_threads=1, minloglevel=2)
    out_path = str(out_path)
    fs, base = fsspec.core.url_to_fs(out_path)
    parent = os.path.dirname(base)
    if parent:
        fs.makedirs(parent, exist_ok=True)
    with fs.open(base, "wb") as f:
        f.write(buf.getvalue())
    return out_path
