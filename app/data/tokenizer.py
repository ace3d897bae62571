"""GPT-2 byte-level BPE tokenizer (Hugging Face `tokenizers`), vocab padding, and BPE training.

The tokenizer is built from the two files of the GPT-2 format, `vocab.json` (token -> id) and
`merges.txt` (one merge per line after a `#version` header). Tokenization is exactly GPT-2's:
the GPT-2 pre-tokenization regex over the byte-level alphabet, then BPE merges by rank. The
end-of-document token is `<|endoftext|>`; its id is `eod`. The literal text "<|endoftext|>"
inside a document is *not* turned into the eod id (it is tokenized as ordinary text), so a
document can never inject a document boundary.

`NullTokenizer` (Megatron-LM's) has no files: a vocabulary size N (--vocab-size), ids 0..N-1
and the end of document N-1; for --mock-data and for data tokenized elsewhere.

`HuggingFaceTokenizer`, `SentencePieceTokenizer` and `GPTSentencePieceTokenizer` (Megatron-LM's)
read --tokenizer-model: a directory with tokenizer.json (transformers' AutoTokenizer, offline)
or a SentencePiece .model file.

`encode_flat` tokenizes a batch into one flat array with gigatoken (a Rust BPE) when it is
installed: the same ids, computed much faster (bench/bench_preprocess.py).

No network access anywhere: everything is built from local files.
"""
from __future__ import annotations

import json
import logging
import os
from typing import Iterable, List, Optional, Sequence, Tuple, Union

import numpy as np

from app.config.data import tokenizer_type_in_effect

logger = logging.getLogger(__name__)

EOD_TOKEN = "<|endoftext|>"
SUPPORTED_TOKENIZERS = ("GPT2BPETokenizer", "NullTokenizer", "HuggingFaceTokenizer",
                        "SentencePieceTokenizer", "GPTSentencePieceTokenizer")
TOKENIZER_MODEL_TYPES = ("HuggingFaceTokenizer", "SentencePieceTokenizer",
                         "GPTSentencePieceTokenizer")
"""The types that read --tokenizer-model instead of --vocab-file."""


class GPT2BPETokenizer:
    """GPT-2 byte-level BPE from vocab.json + merges.txt; tokenize(text) equals GPT-2's encoder.

    Attributes: `vocab_size` (entries in vocab.json, unpadded), `eod` (id of `<|endoftext|>`).
    """

    def __init__(self, vocab_file: str, merge_file: str) -> None:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers

        for flag, path in (("--vocab-file", vocab_file), ("--merge-file", merge_file)):
            if not path:
                raise ValueError(f"GPT2BPETokenizer needs {flag}; train one with "
                                 f"tools/train_tokenizer.py if you have none")
            if not os.path.isfile(path):
                raise FileNotFoundError(f"{flag} {path!r} does not exist; train one with "
                                        f"tools/train_tokenizer.py or fix the path")
        vocab = read_vocab(vocab_file)
        if EOD_TOKEN not in vocab:
            raise ValueError(f"vocab file {vocab_file!r} has no {EOD_TOKEN!r} entry; "
                             f"a GPT-2 vocabulary needs it as the end-of-document token")
        merges = count_merges(merge_file)
        if merges == 0 and len(vocab) > BYTE_SYMBOLS + 1:
            raise ValueError(
                f"--merge-file {merge_file!r} holds no merges, but --vocab-file {vocab_file!r} has "
                f"{len(vocab)} entries (a vocabulary without merges has at most {BYTE_SYMBOLS + 1}): "
                "the file is empty or truncated; pass the merges.txt written with this vocab.json")
        try:
            model = models.BPE.from_file(vocab_file, merge_file)
        except Exception as exc:  # noqa: BLE001  tokenizers raises its own exception type
            raise ValueError(f"--vocab-file {vocab_file!r} and --merge-file {merge_file!r} do not "
                             f"form a BPE tokenizer ({exc}); pass the pair written together by "
                             "tools/train_tokenizer.py (or GPT-2's)") from exc
        tok = Tokenizer(model)
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        tok.decoder = decoders.ByteLevel()
        self._tokenizer = tok
        self.vocab_file = vocab_file
        self.merge_file = merge_file
        self.vocab_size: int = len(vocab)
        self.eod: int = int(vocab[EOD_TOKEN])

    def tokenize(self, text: str) -> List[int]:
        """Token ids of `text` (no special tokens added)."""
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def tokenize_batch(self, texts: Sequence[str]) -> List[List[int]]:
        """`[tokenize(t) for t in texts]`, computed in one call (faster for many short texts)."""
        return [e.ids for e in self._tokenizer.encode_batch(list(texts), add_special_tokens=False)]

    def encode_flat(self, texts: Sequence[str], parallel: Optional[bool] = None
                    ) -> Tuple[np.ndarray, np.ndarray]:
        """(tokens uint32 [total], lengths int64 [len(texts)]): `tokenize` of every text, back to
        back. By gigatoken (a Rust BPE, on its thread pool: RAYON_NUM_THREADS threads; none in a
        multiprocessing worker or with `parallel` False) when it is installed, built from this
        tokenizer and so giving the same ids; else by `tokenizers`."""
        fast = self._gigatoken()
        if fast is not None:
            import awkward as ak
            encoded = fast.encode_batch(list(texts), parallel=parallel)
            lengths = np.asarray(ak.num(encoded, axis=1), dtype=np.int64)
            return np.asarray(ak.flatten(encoded), dtype=np.uint32), lengths
        return flatten_ids(self.tokenize_batch(texts))

    def _gigatoken(self):
        """The gigatoken copy of this tokenizer (made once), or None without gigatoken."""
        if not hasattr(self, "_fast"):
            try:
                import gigatoken
            except ImportError:
                self._fast = None
            else:
                self._fast = gigatoken.Tokenizer(self._tokenizer)
        return self._fast

    @property
    def fast_backend(self) -> str:
        """The library `encode_flat` uses: 'gigatoken' or 'tokenizers'."""
        return "gigatoken" if self._gigatoken() is not None else "tokenizers"

    def detokenize(self, ids: Iterable[int]) -> str:
        """Text of the token ids (inverse of tokenize for valid UTF-8 text)."""
        return self._tokenizer.decode(list(int(i) for i in ids), skip_special_tokens=False)


def flatten_ids(ids: Sequence[Sequence[int]]) -> Tuple[np.ndarray, np.ndarray]:
    """(tokens uint32 [total], lengths int64 [len(ids)]) of token-id lists, back to back."""
    lengths = np.fromiter((len(x) for x in ids), dtype=np.int64, count=len(ids))
    flat = np.fromiter((t for x in ids for t in x), dtype=np.uint32, count=int(lengths.sum()))
    return flat, lengths


class HuggingFaceTokenizer:
    """Megatron-LM's HuggingFaceTokenizer: transformers' AutoTokenizer of --tokenizer-model, a
    directory holding tokenizer.json (and tokenizer_config.json) or a Hub name already in the
    local Hugging Face cache, loaded offline. tokenize(text) is AutoTokenizer(text).input_ids
    (the tokenizer's own special tokens, e.g. a BOS, included, as Megatron's); `vocab_size` is
    len(tokenizer) (added tokens included); `eod` is its eos token (`bos`, `pad`: its bos and
    pad ids, None when it has none)."""

    def __init__(self, tokenizer_model: Optional[str]) -> None:
        if not tokenizer_model:
            raise ValueError("--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model: a "
                             "directory with tokenizer.json, or a Hub name in the local cache")
        if os.path.isfile(tokenizer_model):
            raise ValueError(f"--tokenizer-model {tokenizer_model!r} is a file; give the "
                             "directory that holds tokenizer.json")
        import transformers
        try:
            tok = transformers.AutoTokenizer.from_pretrained(tokenizer_model,
                                                             local_files_only=True)
        except (OSError, ValueError, TypeError) as exc:
            first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc)
            raise ValueError(f"--tokenizer-model {tokenizer_model!r} cannot be loaded offline "
                             f"({first}); give a directory holding tokenizer.json, or a Hub "
                             "name already in the local Hugging Face cache") from None
        if tok.eos_token_id is None:
            raise ValueError(f"--tokenizer-model {tokenizer_model!r} has no eos token, which "
                             "Megatron uses as the end of document; set \"eos_token\" in its "
                             "tokenizer_config.json")
        self._tokenizer = tok
        self.tokenizer_model = tokenizer_model
        self.vocab_size: int = len(tok)
        self.eod: int = int(tok.eos_token_id)
        self.bos: Optional[int] = tok.bos_token_id
        self.pad: Optional[int] = tok.pad_token_id
        self.fast_backend = "transformers"

    def tokenize(self, text: str) -> List[int]:
        """AutoTokenizer(text).input_ids."""
        return list(self._tokenizer(text).input_ids)

    def tokenize_batch(self, texts: Sequence[str]) -> List[List[int]]:
        """`[tokenize(t) for t in texts]` in one call."""
        return [list(x) for x in self._tokenizer(list(texts)).input_ids] if texts else []

    def tokenize_plain(self, text: str) -> List[int]:
        """The ids of `text` alone, no special tokens added (what lm-evaluation-harness scores
        a context or continuation with, as its Hugging Face backend)."""
        return list(self._tokenizer(text, add_special_tokens=False).input_ids)

    def encode_flat(self, texts: Sequence[str], parallel: Optional[bool] = None
                    ) -> Tuple[np.ndarray, np.ndarray]:
        """(tokens uint32 [total], lengths int64 [len(texts)]): `tokenize` of every text."""
        return flatten_ids(self.tokenize_batch(texts))

    def detokenize(self, ids: Iterable[int]) -> str:
        return self._tokenizer.decode([int(i) for i in ids])


class GPTSentencePieceTokenizer:
    """Megatron-LM's GPTSentencePieceTokenizer: a SentencePiece `.model` (--tokenizer-model) as
    it is: tokenize(text) = encode_as_ids(text) (no BOS or EOS added), `vocab_size` its pieces,
    `eod` its eos id; `bos`, `pad`: its bos and pad ids (None where it has none)."""

    def __init__(self, model_file: Optional[str], tokenizer_type: str = "GPTSentencePieceTokenizer"
                 ) -> None:
        if not model_file or not os.path.isfile(model_file):
            raise FileNotFoundError(f"--tokenizer-type {tokenizer_type} needs --tokenizer-model, "
                                    f"a SentencePiece .model file; got {model_file!r}")
        import sentencepiece
        try:
            self._sp = sentencepiece.SentencePieceProcessor(model_file=model_file)
        except (OSError, RuntimeError) as exc:
            raise ValueError(f"--tokenizer-model {model_file!r} is not a SentencePiece model "
                             f"({str(exc).strip()[:200]})") from None
        self.tokenizer_model = model_file
        self.vocab_size: int = len(self._sp)
        self.eod: int = self._sp.eos_id()
        self.bos: Optional[int] = self._sp.bos_id() if self._sp.bos_id() >= 0 else None
        self.pad: Optional[int] = self._sp.pad_id() if self._sp.pad_id() >= 0 else None
        self.fast_backend = "sentencepiece"
        if self.eod < 0 and tokenizer_type == "GPTSentencePieceTokenizer":
            raise ValueError(f"--tokenizer-model {model_file!r} has no eos piece (eos_id -1), "
                             "which GPTSentencePieceTokenizer uses as the end of document; "
                             "train it with an eos_id, or use SentencePieceTokenizer")

    def tokenize(self, text: str) -> List[int]:
        return list(self._sp.encode_as_ids(text))

    def tokenize_batch(self, texts: Sequence[str]) -> List[List[int]]:
        return [self.tokenize(text) for text in texts]

    def encode_flat(self, texts: Sequence[str], parallel: Optional[bool] = None
                    ) -> Tuple[np.ndarray, np.ndarray]:
        return flatten_ids(self.tokenize_batch(texts))

    def detokenize(self, ids: Iterable[int]) -> str:
        return self._sp.decode_ids([int(i) for i in ids])


class SentencePieceTokenizer(GPTSentencePieceTokenizer):
    """Megatron-LM's SentencePieceTokenizer: the `.model`'s pieces plus Megatron's special tokens
    <CLS>, <SEP>, <EOD>, <MASK> and the model's pad/bos/eos pieces (<PAD>/<BOS>/<EOS> when it has
    none), each appended when not a piece already; `eod` is <EOD>, `bos` and `pad` the ids of
    the bos and pad tokens. tokenize() turns those tokens' literal text into their ids and
    SentencePiece-encodes the text between them (NeMo's rule); it adds no BOS or EOS."""

    def __init__(self, model_file: Optional[str]) -> None:
        super().__init__(model_file, "SentencePieceTokenizer")
        vocab = {self._sp.id_to_piece(i): i for i in range(len(self._sp))}
        self._special: dict = {}
        for token in ("<CLS>", "<SEP>", "<EOD>", "<MASK>"):
            self._special[token] = vocab.setdefault(token, len(vocab))
        for get, fallback, name in ((self._sp.pad_id, "<PAD>", "pad"),
                                    (self._sp.bos_id, "<BOS>", "bos"),
                                    (self._sp.eos_id, "<EOS>", "eos")):
            token = self._sp.id_to_piece(get()) if 0 <= get() < len(self._sp) else fallback
            self._special[token] = vocab.setdefault(token, len(vocab))
            setattr(self, name, self._special[token])
        self.vocab_size = len(vocab)
        self.eod = self._special["<EOD>"]

    @property
    def special_tokens(self) -> dict:
        """{token: id} of the special tokens, in the order Megatron adds them."""
        return dict(self._special)

    def tokenize(self, text: str) -> List[int]:
        ids: List[int] = []
        start = 0
        while True:
            found = [(text.find(t, start), t) for t in self._special if text.find(t, start) >= 0]
            if not found:
                break
            at, token = min(found, key=lambda f: f[0])  # the first one found, in order
            ids += self._sp.encode_as_ids(text[start:at]) + [self._special[token]]
            start = at + len(token)
        return ids + list(self._sp.encode_as_ids(text[start:]))

    def detokenize(self, ids: Iterable[int]) -> str:
        inverse = {i: t for t, i in self._special.items()}
        text, piece = "", []
        for i in (int(i) for i in ids):
            if i in inverse:
                text += self._sp.decode_ids(piece) + " " + inverse[i] + " "
                piece = []
            else:
                piece.append(i)
        return text + self._sp.decode_ids(piece)


BYTE_SYMBOLS = 256
"""Byte-level BPE starts from one symbol per byte; every further vocabulary entry but
<|endoftext|> comes from a merge."""


def read_vocab(vocab_file: str) -> dict:
    """The token -> id map of a GPT-2 vocab.json; ValueError naming the file when it is not one."""
    try:
        with open(vocab_file, encoding="utf-8") as f:
            vocab = json.load(f)
    except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError is a ValueError
        raise ValueError(f"--vocab-file {vocab_file!r} is not valid JSON ({exc}); a GPT-2 "
                         "vocab.json maps each token to its id; train one with "
                         "tools/train_tokenizer.py or fix the path") from None
    if not isinstance(vocab, dict) or not vocab:
        raise ValueError(f"--vocab-file {vocab_file!r} holds {type(vocab).__name__} "
                         f"{str(vocab)[:40]}, not a JSON object mapping tokens to ids")
    if not all(isinstance(v, int) for v in vocab.values()):
        raise ValueError(f"--vocab-file {vocab_file!r}: every value must be an integer token id")
    return vocab


def count_merges(merge_file: str) -> int:
    """Merge rules in a GPT-2 merges.txt (lines 'a b' after an optional '#version' header);
    ValueError naming the file and line for a line that is not two symbols."""
    count = 0
    with open(merge_file, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            line = line.rstrip("\r\n")
            if not line or (lineno == 1 and line.startswith("#version")):
                continue
            if len(line.split(" ")) != 2:
                raise ValueError(f"--merge-file {merge_file!r}: line {lineno} ({line[:60]!r}) is "
                                 "not a merge of two symbols separated by one space")
            count += 1
    return count


class NullTokenizer:
    """Megatron-LM's NullTokenizer: no vocabulary file, `vocab_size` ids, end of document
    `vocab_size - 1`; text is token ids written in decimal, separated by whitespace."""

    def __init__(self, vocab_size: int) -> None:
        if vocab_size is None or vocab_size < 2:
            raise ValueError(f"NullTokenizer needs --vocab-size >= 2 (got {vocab_size}): the "
                             "number of token ids, the last one being the end of document")
        self.vocab_size: int = int(vocab_size)
        self.eod: int = self.vocab_size - 1

    def tokenize(self, text: str) -> List[int]:
        """The ids written in `text` ("5 17 2" -> [5, 17, 2])."""
        return [int(token) for token in text.split()]

    def tokenize_batch(self, texts: Sequence[str]) -> List[List[int]]:
        return [self.tokenize(text) for text in texts]

    def detokenize(self, ids: Iterable[int]) -> str:
        return " ".join(str(int(i)) for i in ids)


def build_tokenizer(tokenizer_type: str, vocab_file: Optional[str], merge_file: Optional[str],
                    vocab_size: Optional[int] = None, tokenizer_model: Optional[str] = None
                    ) -> Union[GPT2BPETokenizer, NullTokenizer, HuggingFaceTokenizer,
                               GPTSentencePieceTokenizer]:
    """Tokenizer named by --tokenizer-type (see `tokenizer_type_in_effect`): GPT2BPETokenizer
    from its vocab/merge files, NullTokenizer of `vocab_size` (--vocab-size) ids, or
    HuggingFaceTokenizer, SentencePieceTokenizer or GPTSentencePieceTokenizer of
    `tokenizer_model` (--tokenizer-model)."""
    tokenizer_type = tokenizer_type_in_effect(tokenizer_type, vocab_file, vocab_size)
    if tokenizer_type not in SUPPORTED_TOKENIZERS:
        raise ValueError(f"--tokenizer-type {tokenizer_type!r} is not supported; "
                         f"use one of {', '.join(SUPPORTED_TOKENIZERS)}")
    if tokenizer_type == "NullTokenizer":
        if vocab_file or merge_file:
            raise ValueError("--tokenizer-type NullTokenizer reads no --vocab-file or "
                             "--merge-file; drop them, or use GPT2BPETokenizer")
        tokenizer = NullTokenizer(vocab_size)
    elif tokenizer_type == "HuggingFaceTokenizer":
        tokenizer = HuggingFaceTokenizer(tokenizer_model)
    elif tokenizer_type == "SentencePieceTokenizer":
        tokenizer = SentencePieceTokenizer(tokenizer_model)
    elif tokenizer_type == "GPTSentencePieceTokenizer":
        tokenizer = GPTSentencePieceTokenizer(tokenizer_model)
    else:
        tokenizer = GPT2BPETokenizer(vocab_file, merge_file)
    logger.info("tokenizer %s: vocab %d, eod %d", tokenizer_type, tokenizer.vocab_size, tokenizer.eod)
    return tokenizer


def pad_vocab_size(vocab_size: int, make_vocab_size_divisible_by: int,
                   tensor_model_parallel_size: int) -> int:
    """vocab_size rounded up to a multiple of make_vocab_size_divisible_by x TP (Megatron's rule)."""
    if vocab_size <= 0:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}")
    if make_vocab_size_divisible_by <= 0 or tensor_model_parallel_size <= 0:
        raise ValueError(f"make_vocab_size_divisible_by ({make_vocab_size_divisible_by}) and "
                         f"tensor_model_parallel_size ({tensor_model_parallel_size}) must be positive")
    multiple = make_vocab_size_divisible_by * tensor_model_parallel_size
    return -(-vocab_size // multiple) * multiple


def _train_byte_level_bpe(texts: Iterable[str], vocab_size: int, special_tokens: List[str],
                          min_frequency: int) -> "tokenizers.Tokenizer":
    """A byte-level BPE with GPT-2's pre-tokenizer trained on `texts`: the 256 byte symbols,
    `special_tokens` (ids 0, 1, ...) and the merges learned, at most `vocab_size` entries."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    least = 256 + len(special_tokens)
    if vocab_size < least:
        raise ValueError(f"vocab_size ({vocab_size}) must be at least {least} (256 bytes + "
                         f"{', '.join(special_tokens)})")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                  special_tokens=special_tokens, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def train_gpt2_bpe(texts: Iterable[str], vocab_size: int, output_dir: str,
                   min_frequency: int = 2) -> Tuple[str, str]:
    """Train a GPT-2-format byte-level BPE on `texts`; write vocab.json + merges.txt; return paths.

    The vocabulary holds the 256 byte symbols, `<|endoftext|>` and the learned merges, so its size
    is at most `vocab_size` (smaller when the text runs out of pairs seen `min_frequency` times).
    """
    tok = _train_byte_level_bpe(texts, vocab_size, [EOD_TOKEN], min_frequency)
    os.makedirs(output_dir, exist_ok=True)
    tok.model.save(output_dir)  # writes vocab.json and merges.txt (with a #version header)
    return os.path.join(output_dir, "vocab.json"), os.path.join(output_dir, "merges.txt")


LLAMA_BOS, LLAMA_EOS = "<|begin_of_text|>", "<|end_of_text|>"
"""The special tokens of train_hf_bpe's tokenizers (Llama 3's names)."""


def train_hf_bpe(texts: Iterable[str], vocab_size: int, output_dir: str,
                 min_frequency: int = 2) -> str:
    """Train a Llama-3-style Hugging Face tokenizer on `texts` and save it in `output_dir`
    (tokenizer.json, tokenizer_config.json: what AutoTokenizer and --tokenizer-type
    HuggingFaceTokenizer --tokenizer-model `output_dir` load); returns `output_dir`.

    A byte-level BPE (GPT-2's pre-tokenizer) whose ids 0 and 1 are LLAMA_BOS and LLAMA_EOS; it
    puts LLAMA_BOS before every text, as Llama's tokenizers do, and LLAMA_EOS is its eos token
    (the end of document that --append-eod appends)."""
    from tokenizers import processors

    tok = _train_byte_level_bpe(texts, vocab_size, [LLAMA_BOS, LLAMA_EOS], min_frequency)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{LLAMA_BOS} $A", pair=f"{LLAMA_BOS} $A {LLAMA_BOS} $B",
        special_tokens=[(LLAMA_BOS, tok.token_to_id(LLAMA_BOS))])
    os.makedirs(output_dir, exist_ok=True)
    tok.save(os.path.join(output_dir, "tokenizer.json"))
    with open(os.path.join(output_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": LLAMA_BOS,
                   "eos_token": LLAMA_EOS}, f, indent=2)
    return output_dir
