"""Tokenizers compared by what they do: a GPT-2 BPE as vocab.json + merges.txt and the
tokenizer.json transformers' GPT2TokenizerFast writes for it are one tokenizer (they give the
same ids: checked by tokenizing); a change of vocabulary, merges, end of document, or a
tokenizer.json that adds a BOS, is a difference named in words; which tokenizer a GPT-2
directory imports with follows from its files; a checkpoint's tokenizer check accepts the same
tokenizer under another type and names the flags that load it otherwise."""
import argparse
import json
import shutil

import pytest

from app.checkpoint import CheckpointError
from app.checkpoint.hf.families.gpt2 import import_tokenizer
from app.checkpoint.model_args import check_tokenizer
from app.data.tokenizer import build_tokenizer, train_gpt2_bpe
from app.data.tokenizer_identity import TokenizerSpec, compare_tokenizers, gpt2_bpe_in_directory
from tests.harness.corpus import stdlib_texts

transformers = pytest.importorskip("transformers")
TEXT = "def main(argv):\n    return {'a': 1, 'b': [2, 3]}  # héllo ☃\n\n\tclass X: pass"


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    """{files, hf, other}: a GPT-2 BPE's vocab.json/merges.txt, the transformers GPT-2
    directory of the same BPE (tokenizer.json only), and another BPE of the same size."""
    root = tmp_path_factory.mktemp("tokenizers")
    vocab, merges = train_gpt2_bpe(stdlib_texts(6), 400, str(root / "files"))
    hf = root / "hf"
    transformers.GPT2TokenizerFast(vocab=vocab, merges=merges).save_pretrained(str(hf))
    other = train_gpt2_bpe(stdlib_texts(12)[6:], 400, str(root / "other"))
    return {"files": (vocab, merges), "hf": hf, "other": other}


def spec(kind, path=None, files=None):
    if kind == "GPT2BPETokenizer":
        return TokenizerSpec(kind, *files)
    return TokenizerSpec(kind, tokenizer_model=str(path))


def test_a_gpt2_bpe_in_either_form_is_one_tokenizer(gpt2):
    files = spec("GPT2BPETokenizer", files=gpt2["files"])
    hf = spec("HuggingFaceTokenizer", gpt2["hf"])
    assert not (gpt2["hf"] / "vocab.json").exists()
    match = compare_tokenizers(hf, files)
    assert match.same and match.detail == "the same vocabulary, merges and end-of-document token"
    ours = build_tokenizer("GPT2BPETokenizer", *gpt2["files"])
    theirs = build_tokenizer("HuggingFaceTokenizer", None, None, tokenizer_model=str(gpt2["hf"]))
    assert ours.tokenize(TEXT) == theirs.tokenize(TEXT) and ours.eod == theirs.eod
    assert compare_tokenizers(files, files).same  # the same spec: nothing read


def test_a_real_difference_is_named(gpt2, tmp_path):
    hf = spec("HuggingFaceTokenizer", gpt2["hf"])
    other = compare_tokenizers(hf, spec("GPT2BPETokenizer", files=gpt2["other"]))
    assert other.same is False and other.detail.startswith("token ") and " there, " in other.detail
    vocab, merges = gpt2["files"]
    lines = open(merges).read().splitlines()
    swapped = tmp_path / "merges.txt"  # the same vocabulary, two merges in another order
    swapped.write_text("\n".join(lines[:3] + [lines[4], lines[3]] + lines[5:]) + "\n")
    merge = compare_tokenizers(hf, TokenizerSpec("GPT2BPETokenizer", vocab, str(swapped)))
    assert merge.same is False and merge.detail.startswith("merge 3 is ")  # after the header
    bos = tmp_path / "bos"  # the same BPE, but a BOS put before every text
    shutil.copytree(gpt2["hf"], bos)
    data = json.loads((bos / "tokenizer.json").read_text())
    data["post_processor"] = {"type": "TemplateProcessing",
                              "single": [{"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}},
                                         {"Sequence": {"id": "A", "type_id": 0}}],
                              "pair": [], "special_tokens": {}}
    (bos / "tokenizer.json").write_text(json.dumps(data))
    assert gpt2_bpe_in_directory(str(bos)) is None
    with_bos = compare_tokenizers(spec("HuggingFaceTokenizer", bos), hf)
    assert with_bos.same is False and with_bos.detail.startswith(
        "a Hugging Face tokenizer that is not GPT-2's BPE there, a GPT-2 byte-level BPE of ")


def test_hugging_face_tokenizers_compare_by_content(gpt2, tmp_path):
    copy, eos = tmp_path / "copy", tmp_path / "eos"
    for folder in (copy, eos):
        shutil.copytree(gpt2["hf"], folder)
    data = json.loads((copy / "tokenizer.json").read_text())
    (copy / "tokenizer.json").write_text(json.dumps(data, sort_keys=True, indent=1))
    assert compare_tokenizers(spec("HuggingFaceTokenizer", gpt2["hf"]),
                              spec("HuggingFaceTokenizer", copy)).same
    config = json.loads((eos / "tokenizer_config.json").read_text())
    (eos / "tokenizer_config.json").write_text(json.dumps({**config, "eos_token": "a"}))
    differs = compare_tokenizers(spec("HuggingFaceTokenizer", gpt2["hf"]),
                                 spec("HuggingFaceTokenizer", eos))
    assert differs.same is False and differs.detail.startswith("the end of document is id ")
    assert not compare_tokenizers(TokenizerSpec("NullTokenizer", vocab_size=5),
                                  TokenizerSpec("NullTokenizer", vocab_size=6)).same
    gone = compare_tokenizers(spec("HuggingFaceTokenizer", tmp_path / "gone"),
                              spec("HuggingFaceTokenizer", gpt2["hf"]))
    assert gone.same is None
    assert gone.detail == f"the checkpoint's {tmp_path / 'gone'} not found here"


def test_a_gpt2_directory_imports_as_its_files_say(gpt2, tmp_path):
    vocab, merges = gpt2["files"]
    both = tmp_path / "both"  # GPT-2's files and the same BPE as tokenizer.json (the Hub's gpt2)
    shutil.copytree(gpt2["hf"], both)
    for path in (vocab, merges):
        shutil.copy(path, both)
    fields, carried = import_tokenizer(str(both))
    assert fields == dict(tokenizer_type="GPT2BPETokenizer", vocab_file=str(both / "vocab.json"),
                          merge_file=str(both / "merges.txt"), tokenizer_model=None)
    assert carried == {"vocab.json": str(both / "vocab.json"),
                       "merges.txt": str(both / "merges.txt")}
    files_only = tmp_path / "files"
    shutil.copytree(tmp_path / "both", files_only, ignore=shutil.ignore_patterns("tokenizer*"))
    assert import_tokenizer(str(files_only))[0]["tokenizer_type"] == "GPT2BPETokenizer"
    json_only = import_tokenizer(str(gpt2["hf"]))
    assert json_only == (dict(tokenizer_type="HuggingFaceTokenizer", vocab_file=None,
                              merge_file=None, tokenizer_model=str(gpt2["hf"])), {})
    extended = tmp_path / "extended"  # GPT-2's files beside a tokenizer.json with a token more
    shutil.copytree(both, extended)
    data = json.loads((extended / "tokenizer.json").read_text())
    data["added_tokens"].append({"id": 400, "content": "<pad>", "single_word": False,
                                 "lstrip": False, "rstrip": False, "normalized": False,
                                 "special": True})
    (extended / "tokenizer.json").write_text(json.dumps(data))
    assert import_tokenizer(str(extended))[0]["tokenizer_type"] == "HuggingFaceTokenizer"
    (tmp_path / "none").mkdir()  # no tokenizer at all: GPT-2 BPE without files, as before
    assert import_tokenizer(str(tmp_path / "none")) == (
        dict(tokenizer_type="GPT2BPETokenizer", tokenizer_model=None, vocab_file=None,
             merge_file=None), {})


def test_a_checkpoints_tokenizer_check(gpt2):
    hf = argparse.Namespace(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(gpt2["hf"]))
    vocab, merges = gpt2["files"]
    run = argparse.Namespace(tokenizer_type="GPT2BPETokenizer", vocab_file=vocab, merge_file=merges)
    assert check_tokenizer(hf, run) == [
        f"tokenizer: this run's --tokenizer-type GPT2BPETokenizer --vocab-file {vocab} "
        f"--merge-file {merges} is the checkpoint's --tokenizer-type HuggingFaceTokenizer "
        f"--tokenizer-model {gpt2['hf']}: the same vocabulary, merges and end-of-document token"]
    other = argparse.Namespace(tokenizer_type="GPT2BPETokenizer", vocab_file=gpt2["other"][0],
                               merge_file=gpt2["other"][1])
    with pytest.raises(CheckpointError, match=r"to load it pass --tokenizer-type "
                                              r"GPT2BPETokenizer --vocab-file " + vocab):
        check_tokenizer(run, other)
    with pytest.raises(CheckpointError, match=r"\(or --tokenizer-type GPT2BPETokenizer with "
                                              r"--vocab-file/--merge-file of the same vocabulary "
                                              r"and merges: it is a GPT-2 BPE\)$"):
        check_tokenizer(hf, other)
    older = argparse.Namespace(tokenizer_type="GPT2BPETokenizer", vocab_size=100)  # --vocab-size
    assert check_tokenizer(older, argparse.Namespace(tokenizer_type="NullTokenizer",
                                                     vocab_size=100, vocab_file=None)) == []
    with pytest.raises(CheckpointError, match="cannot be compared"):
        check_tokenizer(older, hf)
