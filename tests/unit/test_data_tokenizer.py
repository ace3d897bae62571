"""GPT2BPETokenizer equals reference GPT-2 tokenizers on tricky text.

References: transformers' GPT2Tokenizer/GPT2TokenizerFast built from the same two files, and a
pure-Python byte-level BPE written here from GPT-2's published algorithm (its regex, its
byte-to-unicode table, merges applied by rank), which shares no code with `tokenizers`.
"""
import json
import os
import sysconfig

import pytest

from app.data.tokenizer import EOD_TOKEN, build_tokenizer, pad_vocab_size, train_gpt2_bpe

TRICKY_TEXTS = [
    "Hello world! It's a test; we've got 12345 numbers and 3.14159.",
    "   leading spaces and trailing   ",
    "tabs\tand\nnew\n\nlines\r\n  \n\t\t indented",
    "unicode: naïve café, Ελληνικά, русский, 中文字符, 日本語, 한국어, emoji 🤖🚀👍🏽, "
    "combining e\u0301 and zero\u200bwidth",
    "def f(x):\n    return {'a': [x ** 2 for x in range(10)]}  # comment\n\n\nclass A(B):\n    pass\n",
    "mixed    whitespace runs\u00a0\u00a0nbsp   \n   \n",
    "'s 't 're 've 'm 'll 'd 'S ''quoted'' \"double\"",
    " ".join(f"word{i}" for i in range(3000)) + " " + "x" * 1500 + " end",
    "",
    "\n",
]


GPT2_PATTERN = (r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")


def _byte_symbols():
    """GPT-2's reversible byte -> printable unicode character table."""
    keep = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1))
            + list(range(ord("\xae"), ord("\xff") + 1)))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


class ReferenceBPE:
    """Plain GPT-2 BPE: split by the GPT-2 regex, map bytes to symbols, merge lowest rank first."""

    def __init__(self, vocab_file, merge_file):
        import regex
        with open(vocab_file, encoding="utf-8") as f:
            self.vocab = json.load(f)
        with open(merge_file, encoding="utf-8") as f:
            lines = [ln.rstrip("\n") for ln in f if ln.strip() and not ln.startswith("#version")]
        self.ranks = {tuple(ln.split(" ")): i for i, ln in enumerate(lines)}
        self.pattern = regex.compile(GPT2_PATTERN)
        self.symbols = _byte_symbols()

    def _bpe(self, word):
        parts = list(word)
        while len(parts) > 1:
            pairs = [(self.ranks.get(p, float("inf")), i) for i, p in enumerate(zip(parts, parts[1:]))]
            rank, _ = min(pairs)
            if rank == float("inf"):
                break
            first, second = next(p for p in zip(parts, parts[1:]) if self.ranks.get(p) == rank)
            merged, i = [], 0
            while i < len(parts):
                if i + 1 < len(parts) and parts[i] == first and parts[i + 1] == second:
                    merged.append(first + second)
                    i += 2
                else:
                    merged.append(parts[i])
                    i += 1
            parts = merged
        return parts

    def encode(self, text):
        ids = []
        for piece in self.pattern.findall(text):
            word = "".join(self.symbols[b] for b in piece.encode("utf-8"))
            ids.extend(self.vocab[p] for p in self._bpe(word))
        return ids


@pytest.fixture(scope="module")
def tokenizer_files(tmp_path_factory):
    stdlib = sysconfig.get_paths()["stdlib"]
    texts = []
    for name in ("textwrap.py", "string.py", "json/decoder.py", "codecs.py"):
        with open(os.path.join(stdlib, name), encoding="utf-8") as f:
            texts.append(f.read())
    texts.append("naïve café Ελληνικά русский 中文 🤖")
    out = tmp_path_factory.mktemp("tok")
    return train_gpt2_bpe(texts, vocab_size=800, output_dir=str(out))


def test_vocab_and_eod(tokenizer_files):
    vocab_file, merge_file = tokenizer_files
    with open(vocab_file, encoding="utf-8") as f:
        vocab = json.load(f)
    tok = build_tokenizer("GPT2BPETokenizer", vocab_file, merge_file)
    assert tok.vocab_size == len(vocab) == 800
    assert tok.eod == vocab[EOD_TOKEN]
    # the literal text of the EOD token is ordinary text, never the eod id
    assert tok.eod not in tok.tokenize("a " + EOD_TOKEN + " b")


@pytest.mark.parametrize("text", TRICKY_TEXTS)
def test_matches_reference_gpt2_tokenizers(tokenizer_files, text):
    from transformers import GPT2Tokenizer, GPT2TokenizerFast

    vocab_file, merge_file = tokenizer_files
    ours = build_tokenizer("GPT2BPETokenizer", vocab_file, merge_file)
    hf = GPT2Tokenizer(vocab=vocab_file, merges=merge_file)
    hf_fast = GPT2TokenizerFast(vocab=vocab_file, merges=merge_file)
    ids = ours.tokenize(text)
    assert ids == ReferenceBPE(vocab_file, merge_file).encode(text)
    assert ids == hf.encode(text) == hf_fast.encode(text)
    assert ours.tokenize_batch([text, text]) == [ids, ids]
    assert ours.detokenize(ids) == text


def test_encode_flat_is_tokenize_back_to_back_on_either_backend(tokenizer_files):
    """The fast batch path (gigatoken when installed) gives the reference BPE's ids, and so does
    its `tokenizers` fallback; the literal EOD text stays text on both."""
    vocab_file, merge_file = tokenizer_files
    texts = list(TRICKY_TEXTS) + ["", "a " + EOD_TOKEN + " b", "x" * 5000, "\r\n\t  \u00a0"]
    reference = ReferenceBPE(vocab_file, merge_file)
    want = [reference.encode(t) for t in texts]
    for fast in (True, False):
        tok = build_tokenizer("GPT2BPETokenizer", vocab_file, merge_file)
        if not fast:
            tok._fast = None  # the `tokenizers` fallback
        flat, lengths = tok.encode_flat(texts, parallel=False)
        assert flat.dtype.name == "uint32" and lengths.tolist() == [len(w) for w in want]
        assert flat.tolist() == [i for w in want for i in w], tok.fast_backend


def test_errors_name_the_problem(tmp_path, tokenizer_files):
    vocab_file, merge_file = tokenizer_files
    with pytest.raises(ValueError, match="GPT2BPETokenizer"):
        build_tokenizer("BertWordPieceLowerCase", vocab_file, merge_file)
    with pytest.raises(FileNotFoundError, match="nope.json"):
        build_tokenizer("GPT2BPETokenizer", str(tmp_path / "nope.json"), merge_file)
    bad_vocab = tmp_path / "vocab.json"
    bad_vocab.write_text(json.dumps({"a": 0, "b": 1}))
    with pytest.raises(ValueError, match="endoftext"):
        build_tokenizer("GPT2BPETokenizer", str(bad_vocab), merge_file)


@pytest.mark.parametrize("content", ["", "garbage{", "[1, 2]", "{}"])
def test_empty_or_garbage_vocab_is_an_error_naming_the_file(tmp_path, tokenizer_files, content):
    bad = tmp_path / "vocab.json"
    bad.write_text(content)
    with pytest.raises(ValueError, match=r"--vocab-file .*vocab\.json"):
        build_tokenizer("GPT2BPETokenizer", str(bad), tokenizer_files[1])


def test_empty_or_broken_merges_are_errors_naming_the_file(tmp_path, tokenizer_files):
    vocab_file, merge_file = tokenizer_files
    empty = tmp_path / "merges.txt"
    for text in ("", "#version: 0.2\n"):
        empty.write_text(text)
        with pytest.raises(ValueError, match=r"--merge-file .*merges\.txt' holds no merges.*800"):
            build_tokenizer("GPT2BPETokenizer", vocab_file, str(empty))
    empty.write_text("#version: 0.2\na b c\n")
    with pytest.raises(ValueError, match="line 2"):
        build_tokenizer("GPT2BPETokenizer", vocab_file, str(empty))
    # a byte-level vocabulary without merges (256 bytes + eod) needs none
    with open(vocab_file, encoding="utf-8") as f:
        vocab = json.load(f)
    small = {tok: i for i, tok in enumerate(t for t in vocab if vocab[t] < 256)}
    small[EOD_TOKEN] = len(small)
    (tmp_path / "small.json").write_text(json.dumps(small))
    empty.write_text("")
    assert build_tokenizer("GPT2BPETokenizer", str(tmp_path / "small.json"),
                           str(empty)).vocab_size == len(small)


@pytest.mark.parametrize("vocab,div,tp,expected", [
    (50257, 128, 1, 50304), (50257, 128, 2, 50432), (50304, 128, 1, 50304),
    (800, 128, 4, 1024), (1, 1, 1, 1), (129, 64, 1, 192)])
def test_pad_vocab_size(vocab, div, tp, expected):
    assert pad_vocab_size(vocab, div, tp) == expected


def test_pad_vocab_size_rejects_nonpositive():
    with pytest.raises(ValueError, match="tensor_model_parallel_size"):
        pad_vocab_size(100, 128, 0)


def testtrain_hf_tokenizer_cli(tmp_path):
    from tools.train_tokenizer import main

    corpus = tmp_path / "c.jsonl"
    corpus.write_text("\n".join(json.dumps({"text": f"line {i} of text, more words {i % 7}"})
                                for i in range(200)) + "\n")
    main(["--input", str(corpus), "--json-keys", "text", "--vocab-size", "300",
          "--output-dir", str(tmp_path / "tok")])
    tok = build_tokenizer("GPT2BPETokenizer", str(tmp_path / "tok/vocab.json"),
                          str(tmp_path / "tok/merges.txt"))
    assert 257 < tok.vocab_size <= 300
    assert tok.detokenize(tok.tokenize("line 3 of text")) == "line 3 of text"
