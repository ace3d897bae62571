"""Tokenizers trained here for tests (no downloads)."""
import json
import os


TEXTS = ["hello world, the quick brown fox", "jumps over the lazy dog.", "", "héllo ☃ wörld",
         "the fox and the dog </s> are friends"] * 8


def train_hf_tokenizer(directory, eos="</s>"):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(TEXTS * 4, trainer=trainer)
    # a BOS before every document, as Llama's tokenizers add
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    os.makedirs(directory, exist_ok=True)
    tok.save(os.path.join(directory, "tokenizer.json"))
    config = {"bos_token": "<s>"} | ({"eos_token": eos} if eos else {})
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump(config, f)
    return str(directory)


def write_tiktoken_ranks(path, merges=(b"th", b"he", b"the", b" t", b"in", b"ing", b" th",
                                       b" the", b"fo", b"fox", b" fox")):
    """A Megatron tiktoken rank file (a JSON list of {rank, token_bytes, token_str}): ranks
    0..255 the single bytes, then `merges` in order. Returns the path."""
    import base64
    tokens = [bytes([i]) for i in range(256)] + list(merges)
    entries = [{"rank": i, "token_bytes": base64.b64encode(t).decode("ascii"),
                "token_str": t.decode("utf-8", errors="replace")} for i, t in enumerate(tokens)]
    with open(path, "w", encoding="utf-8") as f:
        json.dump(entries, f)
    return str(path)


def train_sentencepiece(path, texts=TEXTS * 4, vocab_size=60, **options):
    """A SentencePiece BPE model of `vocab_size` pieces trained on `texts`, written to `path`
    (`options`: SentencePieceTrainer's, e.g. pad_id); returns the path."""
    import sentencepiece
    with open(path, "wb") as f:
        sentencepiece.SentencePieceTrainer.train(sentence_iterator=iter(texts), model_writer=f,
                                                 vocab_size=vocab_size, model_type="bpe",
                                                 minloglevel=2, **options)
    return str(path)
