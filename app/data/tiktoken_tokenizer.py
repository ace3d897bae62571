"""Megatron-LM's TikTokenizer (--tokenizer-type TikTokenizer): byte-level BPE by the `tiktoken`
package over a rank file, with Megatron's block of special tokens in front.

--tokenizer-model is a JSON list of `{"rank": i, "token_bytes": base64, "token_str": str}`
entries with `rank == i`, the first 256 being the single bytes 0..255 (what Megatron's
reload_mergeable_ranks reads). The ids are Megatron's (megatron/core/tokenizers, main):

- ids 0..S-1 are the special tokens, S = --tiktoken-num-special-tokens (1000): the
  --tokenizer-special-tokens list (default `<unk> <s> </s> <mask> <pad> <cls> <sep>`, which any
  list must include), then fillers `<SPECIAL_i>` up to S;
- the rank file's entry r is id r + S; the file is cut to --vocab-size - S entries (--vocab-size
  defaults to 2**17) and must hold that many;
- the end of document is `</s>`, the beginning `<s>`, the padding `<pad>`;
- text is split by the v1 or v2 pattern (--tiktoken-pattern, default v2) and encoded with the
  special tokens' literal text allowed (`<s>` in the text becomes id 1).
"""
from __future__ import annotations

import base64
import json
import os
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np

from app.data.token_ids import flatten_ids

PATTERNS = {
    "v1": r"[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+",
    "v2": (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
           r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
           r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"),
}
"""The pre-tokenisation regexes of --tiktoken-pattern (Megatron's _PATTERN_TIKTOKEN_V1/V2)."""
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<mask>", "<pad>", "<cls>", "<sep>")
"""The special tokens every TikTokenizer has, first by default (ids 0..6)."""
DEFAULT_VOCAB_SIZE = 2 ** 17
DEFAULT_NUM_SPECIAL_TOKENS = 1000


def read_ranks(path: str, entries: int) -> Dict[bytes, int]:
    """{token bytes: rank} of the first `entries` entries of a Megatron tiktoken rank file;
    ValueError naming the file and the entry that breaks its format."""
    if not path.endswith(".json") or not os.path.isfile(path):
        raise ValueError(f"--tokenizer-model {path!r}: TikTokenizer reads a .json rank file "
                         "(a list of {rank, token_bytes, token_str} entries)")
    with open(path, encoding="utf-8") as f:
        vocab = json.load(f)
    if not isinstance(vocab, list):
        raise ValueError(f"--tokenizer-model {path!r} holds a {type(vocab).__name__}, not the "
                         "list of rank entries TikTokenizer reads")
    ranks: Dict[bytes, int] = {}
    for i, entry in enumerate(vocab[:entries]):
        if not isinstance(entry, dict) or set(entry) != {"rank", "token_bytes", "token_str"} \
                or entry["rank"] != i:
            raise ValueError(f"--tokenizer-model {path!r}: entry {i} is not "
                             f"{{\"rank\": {i}, \"token_bytes\": ..., \"token_str\": ...}}")
        token = base64.b64decode(entry["token_bytes"])
        if i < 256 and token != bytes([i]):
            raise ValueError(f"--tokenizer-model {path!r}: entry {i} must be the single byte "
                             f"{i} (the first 256 ranks are the bytes)")
        if token in ranks:
            raise ValueError(f"--tokenizer-model {path!r}: entry {i} repeats entry "
                             f"{ranks[token]}'s bytes")
        ranks[token] = i
    return ranks


class TikTokenizer:
    """Megatron-LM's TikTokenizer (module docstring): `vocab_size` (--vocab-size or 2**17),
    `eod` (`</s>`), `bos` (`<s>`), `pad` (`<pad>`), tokenize(text) / detokenize(ids)."""

    def __init__(self, tokenizer_model: Optional[str], pattern: Optional[str] = None,
                 vocab_size: Optional[int] = None,
                 num_special_tokens: int = DEFAULT_NUM_SPECIAL_TOKENS,
                 special_tokens: Optional[Sequence[str]] = None) -> None:
        import tiktoken
        if not tokenizer_model:
            raise ValueError("--tokenizer-type TikTokenizer needs --tokenizer-model, a .json "
                             "rank file")
        pattern = pattern or "v2"
        if pattern not in PATTERNS:
            raise ValueError(f"--tiktoken-pattern must be v1 or v2, got {pattern!r}")
        self.vocab_size = int(vocab_size or DEFAULT_VOCAB_SIZE)
        specials = self._special_tokens(special_tokens, num_special_tokens, self.vocab_size)
        entries = self.vocab_size - num_special_tokens
        ranks = read_ranks(tokenizer_model, entries)
        if len(ranks) != entries:
            raise ValueError(f"--tokenizer-model {tokenizer_model!r} holds {len(ranks)} ranks, but "
                             f"--vocab-size {self.vocab_size} less {num_special_tokens} special "
                             f"tokens needs {entries}: lower --vocab-size to "
                             f"{len(ranks) + num_special_tokens}")
        self._encoding = tiktoken.Encoding(
            name=os.path.basename(os.path.dirname(os.path.abspath(tokenizer_model))),
            pat_str=PATTERNS[pattern],
            mergeable_ranks={t: r + num_special_tokens for t, r in ranks.items()},
            special_tokens={t: i for i, t in enumerate(specials)})
        self.tokenizer_model = tokenizer_model
        self.special_tokens: Tuple[str, ...] = tuple(specials)
        self.eod = specials.index("</s>")
        self.bos = specials.index("<s>")
        self.pad = specials.index("<pad>")
        self.fast_backend = "tiktoken"

    @staticmethod
    def _special_tokens(given: Optional[Sequence[str]], count: int, vocab_size: int) -> List[str]:
        """The special tokens in id order: `given` (or SPECIAL_TOKENS), then fillers up to
        `count`; ValueError naming the flags when they do not fit Megatron's rules."""
        tokens = list(given) if given else list(SPECIAL_TOKENS)
        missing = [t for t in SPECIAL_TOKENS if t not in tokens]
        if missing or len(set(tokens)) != len(tokens):
            raise ValueError(f"--tokenizer-special-tokens must be distinct and include "
                             f"{' '.join(SPECIAL_TOKENS)} (missing: {' '.join(missing) or '-'})")
        if not len(tokens) <= count < vocab_size:
            raise ValueError(f"--tiktoken-num-special-tokens ({count}) must be at least the "
                             f"{len(tokens)} special tokens and below --vocab-size "
                             f"({vocab_size})")
        fillers = [f"<SPECIAL_{i}>" for i in range(len(tokens), count)]
        if set(fillers) & set(tokens):
            raise ValueError("--tokenizer-special-tokens may not name the <SPECIAL_i> fillers")
        return tokens + fillers

    def tokenize(self, text: str) -> List[int]:
        """The ids of `text`, special tokens' text included (Megatron's text_to_ids)."""
        return self._encoding.encode(text, allowed_special="all")

    def tokenize_batch(self, texts: Sequence[str]) -> List[List[int]]:
        return self._encoding.encode_batch(list(texts), allowed_special="all")

    def encode_flat(self, texts: Sequence[str], parallel: Optional[bool] = None
                    ) -> Tuple[np.ndarray, np.ndarray]:
        """(tokens uint32 [total], lengths int64 [len(texts)]) of `tokenize` of every text."""
        return flatten_ids(self.tokenize_batch(texts))

    def detokenize(self, ids: Iterable[int]) -> str:
        return self._encoding.decode([int(i) for i in ids])
