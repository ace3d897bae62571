"""Megatron-LM's TikTokenizer and Llama2Tokenizer against Megatron Core's own tokenizer classes
(megatron-core in the venv, the library its pretrain_gpt.py builds them from) on vocabularies
made here, and against a hand-worked BPE example; preprocess_data.py writes their ids."""
import json

import numpy as np
import pytest

from app.data.tokenizer import build_tokenizer, build_tokenizer_from
from tests.harness.tokenizers import TEXTS, train_sentencepiece, write_tiktoken_ranks

pytest.importorskip("tiktoken")
STRINGS = ["the thing", "The fox, the THING and 42 things\n\n  in  fox!", "<s>the</s> <pad>",
           "héllo ☃ wörld", ""]


def _megatron_tiktoken(path, **kw):
    from megatron.core.tokenizers.text.libraries.tiktoken_tokenizer import TikTokenTokenizer
    return TikTokenTokenizer(path, **kw)


@pytest.mark.parametrize("pattern", ["v1", "v2"])
def test_tiktokenizer_ids_are_megatrons(tmp_path, pattern):
    path = write_tiktoken_ranks(tmp_path / "ranks.json")  # 256 bytes + 11 merges
    ours = build_tokenizer("TikTokenizer", None, None, vocab_size=277, tokenizer_model=path,
                           tiktoken_pattern=pattern, tiktoken_num_special_tokens=10)
    theirs = _megatron_tiktoken(path, pattern=pattern, num_special_tokens=10, vocab_size=277)
    assert (ours.vocab_size, ours.eod, ours.bos, ours.pad) == \
        (theirs.vocab_size, theirs.eod, theirs.bos_id, theirs.pad_id) == (277, 2, 1, 4)
    for text in STRINGS:
        assert ours.tokenize(text) == theirs.text_to_ids(text), text
        assert ours.detokenize(ours.tokenize(text)) == text
    # by hand: "the" -> th (256) -> the (258); " thing" -> th, in (260), ing (261), " th" (262)
    assert ours.tokenize("the thing") == [258 + 10, 262 + 10, 261 + 10]
    assert ours.tokenize("<s>the</s>") == [1, 268, 2]  # special tokens' text allowed


def test_tiktokenizer_defaults_and_refusals(tmp_path):
    path = write_tiktoken_ranks(tmp_path / "ranks.json")
    with pytest.raises(ValueError, match="holds 267 ranks, but --vocab-size 131072"):
        build_tokenizer("TikTokenizer", None, None, tokenizer_model=path)  # 2**17 by default
    with pytest.raises(ValueError, match=r"must be distinct and include .* \(missing: <sep>\)"):
        build_tokenizer("TikTokenizer", None, None, vocab_size=1267, tokenizer_model=path,
                        special_tokens=["<unk>", "<s>", "</s>", "<mask>", "<pad>", "<cls>"])
    with pytest.raises(ValueError, match="entry 256 repeats entry 111"):
        build_tokenizer("TikTokenizer", None, None, vocab_size=1257, tokenizer_model=(
            write_tiktoken_ranks(tmp_path / "bad.json", merges=[b"o"])))
    with pytest.raises(ValueError, match="a .json rank file"):
        build_tokenizer("TikTokenizer", None, None, tokenizer_model=str(tmp_path))
    # the run's flags: --vocab-size is TikTokenizer's size, the 1000 special ids come first
    import arguments
    args = arguments.parse_args(["--tokenizer-type", "TikTokenizer", "--tokenizer-model", path,
                                 "--vocab-size", "1267", "--tiktoken-pattern", "v1"])
    tok = build_tokenizer_from(args)
    theirs = _megatron_tiktoken(path, pattern="v1", vocab_size=1267)
    assert tok.vocab_size == 1267 and tok.tokenize(STRINGS[1]) == theirs.text_to_ids(STRINGS[1])


@pytest.fixture(scope="module")
def sentencepiece_model(tmp_path_factory):
    pytest.importorskip("sentencepiece")
    return train_sentencepiece(tmp_path_factory.mktemp("spm") / "llama.model")


def test_llama2_tokenizer_is_megatrons_sentencepiece(sentencepiece_model):
    """Today's Megatron builds Llama2Tokenizer as its plain SentencePiece wrapper: the model's
    pieces, no BOS added, the end of document its eos."""
    from megatron.core.tokenizers.text.libraries.sentencepiece_tokenizer import (
        SentencePieceTokenizer)
    theirs = SentencePieceTokenizer(sentencepiece_model)
    ours = build_tokenizer("Llama2Tokenizer", None, None, tokenizer_model=sentencepiece_model)
    assert (ours.vocab_size, ours.eod) == (theirs.vocab_size, theirs.eos_id) == (60, 2)
    for text in TEXTS[:5]:
        assert ours.tokenize(text) == theirs.text_to_ids(text), text


def test_preprocess_writes_the_tiktokenizer_ids(tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    from tools.preprocess_data import main
    path = write_tiktoken_ranks(tmp_path / "ranks.json")
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in STRINGS[:4]))
    main(["--input", str(data), "--output-prefix", str(tmp_path / "docs"), "--append-eod",
          "--workers", "1", "--tokenizer-type", "TikTokenizer", "--tokenizer-model", path,
          "--vocab-size", "277", "--tiktoken-num-special-tokens", "10"])
    dataset = IndexedDataset(str(tmp_path / "docs_text_document"))
    theirs = _megatron_tiktoken(path, num_special_tokens=10, vocab_size=277)
    for i, text in enumerate(STRINGS[:4]):
        np.testing.assert_array_equal(dataset[i], theirs.text_to_ids(text) + [theirs.eod])


def test_a_checkpoints_tiktokenizer_is_compared_with_its_settings(tmp_path, sentencepiece_model):
    """A resume checks the tokenizer by what decides its ids: TikTokenizer's rank file with its
    size, pattern and special tokens (another pattern is another tokenizer); Llama2Tokenizer is
    GPTSentencePieceTokenizer of the same .model."""
    import argparse
    from app.data.tokenizer_identity import TokenizerSpec, compare_tokenizers
    path = write_tiktoken_ranks(tmp_path / "ranks.json")
    copy = tmp_path / "copy.json"
    copy.write_bytes((tmp_path / "ranks.json").read_bytes())

    def spec(**kw):
        args = dict(tokenizer_type="TikTokenizer", tokenizer_model=path, vocab_size=1267,
                    tiktoken_pattern=None, tiktoken_num_special_tokens=1000,
                    tokenizer_special_tokens=None)
        return TokenizerSpec.from_args(argparse.Namespace(**{**args, **kw}))
    assert compare_tokenizers(spec(), spec(tokenizer_model=str(copy))).same
    assert compare_tokenizers(spec(), spec(tiktoken_pattern="v2", tokenizer_model=str(copy))).same
    for other in (dict(tiktoken_pattern="v1"), dict(vocab_size=1266),
                  dict(tiktoken_num_special_tokens=999, vocab_size=1266)):
        assert compare_tokenizers(spec(), spec(tokenizer_model=str(copy), **other)).same is False
    llama2, gpt = (TokenizerSpec(kind, tokenizer_model=sentencepiece_model)
                   for kind in ("Llama2Tokenizer", "GPTSentencePieceTokenizer"))
    assert compare_tokenizers(llama2, gpt).same
