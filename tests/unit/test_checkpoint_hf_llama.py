"""Hugging Face Llama and Qwen3 both ways (app.checkpoint.hf.families.llama, through the
converter): a directory written by transformers' own save_pretrained (sharded safetensors, a
tokenizer.json tokenizer) goes to our legacy format at TP2 x PP2 and back to Hugging Face with every tensor and
the config unchanged; an export of our model loads as LlamaForCausalLM / Qwen3ForCausalLM with
no missing or unexpected weight and gives our logits; a GPT-2 model still exports as GPT-2; what
neither can express is refused by name."""
import json
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

L, H, HEADS, GROUPS, HD, FFN = 2, 32, 4, 2, 16, 48
VOCAB = 320  # >= the test tokenizer's 318 tokens (tests/unit/test_data_tokenizer_hf.py trains it)


def _convert(*argv):
    from tools.convert_checkpoint import main
    assert main([str(a) for a in argv]) == 0


def _hf_source(tmp_path, kind: str):
    """A random Llama (GQA 2 groups, head_dim 16, untied) or Qwen3 (q/k norms, tied) saved by
    transformers in 3+ safetensors shards, with a tokenizer.json tokenizer beside it."""
    from tests.harness.tokenizers import train_hf_tokenizer
    source = str(tmp_path / f"{kind}_source")
    train_hf_tokenizer(source)
    common = dict(vocab_size=VOCAB, hidden_size=H, intermediate_size=FFN, num_hidden_layers=L,
                  num_attention_heads=HEADS, num_key_value_heads=GROUPS, head_dim=HD,
                  max_position_embeddings=64, rms_norm_eps=1e-6, bos_token_id=0,
                  eos_token_id=1, rope_parameters={"rope_type": "default",
                                                   "rope_theta": 500000.0})
    if kind == "llama":
        config = transformers.LlamaConfig(**common, tie_word_embeddings=False)
        model = transformers.LlamaForCausalLM(config)
    elif kind == "llama31":  # Llama 3.1's RoPE scaling
        common["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 500000.0,
                                     "factor": 32.0, "low_freq_factor": 1.0,
                                     "high_freq_factor": 4.0,
                                     "original_max_position_embeddings": 8192}
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    elif kind == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
    elif kind == "nemotron":
        common.pop("rms_norm_eps")
        common["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0,
                                     "partial_rotary_factor": 0.5}
        model = transformers.NemotronForCausalLM(transformers.NemotronConfig(
            **common, norm_eps=1e-5, tie_word_embeddings=False))
    else:
        config = transformers.Qwen3Config(**common, tie_word_embeddings=True)
        model = transformers.Qwen3ForCausalLM(config)
    torch.manual_seed(0)
    with torch.no_grad():  # norms away from 1 (Nemotron's: 1 + weight), so a swapped one shows
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
            elif name.endswith("bias"):  # Qwen2's q/k/v biases start at zero
                param.normal_()
    model.save_pretrained(source, max_shard_size="40KB")
    return source, model.eval()


def _tensors(path):
    from app.checkpoint.hf.files import read_hf_tensors
    return read_hf_tensors(str(path))


def _config(path):
    keep = transformers.AutoConfig.from_pretrained(str(path)).to_dict()
    return {k: v for k, v in keep.items() if k not in ("transformers_version", "_name_or_path")}


@pytest.mark.parametrize("kind, tp, pp", [("llama", 2, 2), ("qwen3", 2, 1), ("llama31", 2, 1),
                                          ("qwen2", 2, 1), ("nemotron", 2, 2)])
def test_hf_to_ours_at_tp_pp_and_back_is_exact(tmp_path, kind, tp, pp):
    source, reference = _hf_source(tmp_path, kind)
    assert os.path.isfile(os.path.join(source, "model.safetensors.index.json"))  # sharded
    ours, back = tmp_path / "ours", tmp_path / "back"
    _convert("--load", source, "--save", ours, "--output-format", "torch",
             "--target-tensor-model-parallel-size", tp, "--target-pipeline-model-parallel-size",
             pp)
    assert sorted(os.listdir(ours / "release")) == sorted(
        f"mp_rank_{t:02d}" + (f"_{p:03d}" if pp > 1 else "") for t in range(tp) for p in range(pp))
    # the tokenizer the import named in the args (llama), or --tokenizer-model (qwen3)
    _convert("--load", ours, "--save", back, "--output-format", "hf",
             *(["--tokenizer-model", source] if kind == "qwen3" else []))
    args = torch.load(ours / "release" / "mp_rank_00" / "model_optim_rng.pt" if pp == 1 else
                      ours / "release" / "mp_rank_00_000" / "model_optim_rng.pt",
                      weights_only=False)["args"]  # the import's model options, Megatron's names
    assert (args.use_rope_scaling, args.add_qkv_bias, args.layernorm_zero_centered_gamma,
            args.squared_relu) == (kind == "llama31", kind == "qwen2", kind == "nemotron",
                                   kind == "nemotron")
    want, got = _tensors(source), _tensors(back)
    assert sorted(want) == sorted(got)
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name
    assert _config(back) == _config(source)
    # the tokenizer travels: the import names the source's, the export saves it
    tok, tok_back = (transformers.AutoTokenizer.from_pretrained(str(p)) for p in (source, back))
    text = "the quick brown fox"
    assert tok_back(text).input_ids == tok(text).input_ids
    assert tok_back.eos_token_id == tok.eos_token_id == 1
    model = transformers.AutoModelForCausalLM.from_pretrained(str(back)).eval()
    assert type(model) is type(reference)
    ids = torch.tensor([tok(text).input_ids])
    torch.testing.assert_close(model(ids).logits, reference(ids).logits, rtol=0, atol=0)


def _our_model(*flags, vocab: int = 60):
    import arguments
    from app.checkpoint.model_args import checkpoint_args_namespace
    from app.checkpoint.state import ModelCheckpoint
    from app.model import GPT2Model
    argv = ["--num-layers", str(L), "--hidden-size", str(H), "--num-attention-heads",
            str(HEADS), "--seq-length", "16", "--micro-batch-size", "2", "--train-iters", "2",
            "--hidden-dropout", "0", "--attention-dropout", "0",
            "--make-vocab-size-divisible-by", "32", *flags]
    cfg = arguments.config_from_argv(argv, 1, vocab)
    torch.manual_seed(1)
    model = GPT2Model(cfg.model).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "layernorm" in name:
                param.uniform_(0.5, 1.5)
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    return model, ModelCheckpoint(args=checkpoint_args_namespace(cfg, 0, 0, 0), weights=weights)


LLAMA = ["--swiglu", "--normalization", "RMSNorm", "--norm-epsilon", "1e-6",
         "--disable-bias-linear", "--position-embedding-type", "rope", "--rotary-base", "500000",
         "--kv-channels", str(HD), "--ffn-hidden-size", str(FFN), "--group-query-attention",
         "--num-query-groups", str(GROUPS)]


@pytest.mark.parametrize("flags, architecture", [
    (LLAMA + ["--untie-embeddings-and-output-weights"], "LlamaForCausalLM"),
    (LLAMA + ["--qk-layernorm"], "Qwen3ForCausalLM"),
    ([], "GPT2LMHeadModel")])
def test_our_model_exports_as_its_architecture_with_our_logits(tmp_path, flags, architecture):
    from app.checkpoint import hf
    model, source = _our_model(*flags)
    assert hf.write_model(source, str(tmp_path)) == architecture
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == [architecture] and config["vocab_size"] == 60
    if architecture != "GPT2LMHeadModel":
        assert (config["rope_theta"], config["rms_norm_eps"], config["num_key_value_heads"],
                config["head_dim"], config["attention_bias"]) == (500000.0, 1e-6, GROUPS, HD,
                                                                  False)
        assert config["tie_word_embeddings"] == ("--qk-layernorm" in flags)
    hf_model, info = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), output_loading_info=True)
    assert type(hf_model).__name__ == architecture
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert "## Architecture" in (tmp_path / "README.md").read_text()
    tokens = torch.randint(0, 60, (2, 16), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(hf_model.eval()(input_ids=tokens).logits, model(tokens)[..., :60],
                               rtol=1e-4, atol=1e-4)


LLAMA31 = LLAMA + ["--use-rope-scaling", "--rope-scaling-factor", "32",
                   "--untie-embeddings-and-output-weights"]
NEMOTRON = ["--apply-layernorm-1p", "--squared-relu", "--use-rotary-position-embeddings",
            "--no-position-embedding", "--rotary-percent", "0.5", "--rotary-base", "10000",
            "--disable-bias-linear", "--kv-channels", str(HD), "--ffn-hidden-size", str(FFN),
            "--group-query-attention", "--num-query-groups", str(GROUPS),
            "--untie-embeddings-and-output-weights"]


@pytest.mark.parametrize("flags, architecture", [
    (LLAMA31, "LlamaForCausalLM"),  # Llama 3.1's RoPE scaling
    (LLAMA31 + ["--apply-layernorm-1p"], "LlamaForCausalLM"),  # RMSNorm-1p: 1 + weight
    (LLAMA + ["--add-qkv-bias"], "Qwen2ForCausalLM"),
    (LLAMA + ["--add-qkv-bias", "--use-rope-scaling", "--apply-layernorm-1p"],
     "Qwen2ForCausalLM"),
    (NEMOTRON, "NemotronForCausalLM"),
    (NEMOTRON[1:], "NemotronForCausalLM"),  # plain LayerNorm: written as weight - 1
    (["--apply-layernorm-1p"], "GPT2LMHeadModel"),
])
def test_megatrons_model_options_export_with_our_logits(tmp_path, flags, architecture):
    """Megatron's launch-script options through the Hugging Face export: transformers' own
    model of the written directory gives our logits (fp32, 1e-5), with Llama 3.1's RoPE scaling
    at positions 5000 and on (where its scaled frequencies move the logits); the same model
    without its RoPE scaling or with its norms read as plain ones does not (the comparison can
    fail)."""
    from app.checkpoint import hf
    model, source = _our_model(*flags)
    with torch.no_grad():  # biases away from zero and large attention scores, so a dropped
        for name, param in model.named_parameters():  # bias or a misplaced rotation shows
            if name.endswith("bias") and "layernorm" not in name:
                param.normal_()
            elif "query_key_value" in name:
                param.normal_(0.0, 0.5)
            source.weights[name] = param.detach().clone()
    assert hf.write_model(source, str(tmp_path)) == architecture
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
    assert type(hf_model).__name__ == architecture
    tokens = torch.randint(0, 60, (2, 16), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(16).unsqueeze(0) + (5000 if "--use-rope-scaling" in flags else 0)
    ours = model(tokens, positions)[..., :60]
    theirs = hf_model(input_ids=tokens, position_ids=positions).logits
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)
    if "--use-rope-scaling" in flags:
        plain = dict(rope_type="default", rope_theta=500000.0)
        unscaled = type(hf_model)(type(hf_model.config)(**{
            **hf_model.config.to_dict(), "rope_parameters": plain, "rope_scaling": None}))
        unscaled.load_state_dict(hf_model.state_dict())
        assert (unscaled.eval()(input_ids=tokens, position_ids=positions).logits
                - ours).abs().max() > 1e-3
    if "--apply-layernorm-1p" in flags:
        model.config.layernorm_zero_centered_gamma = False
        for module in model.modules():
            if hasattr(module, "zero_centered_gamma"):
                module.zero_centered_gamma = False  # the same weights as plain gammas
        assert (model(tokens, positions)[..., :60] - theirs).abs().max() > 1e-3


def test_what_no_architecture_expresses_is_refused_by_name(tmp_path):
    from app.checkpoint.hf.families import llama as hf_llama
    from app.checkpoint.hf.files import HFConversionError
    from app.checkpoint.model_args import model_config_from_args
    from app.checkpoint.hf import export_architecture
    _, layernorm_llama = _our_model(*[f for f in LLAMA if f not in ("--normalization", "RMSNorm")])
    with pytest.raises(ValueError, match="neither a Hugging Face GPT-2.*--normalization "
                                         "LayerNorm: Llama's norms are RMSNorm"):
        export_architecture(model_config_from_args(layernorm_llama.args, for_inference=True))
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=H, intermediate_size=FFN,
                                      num_hidden_layers=L, num_attention_heads=HEADS).to_dict()
    for change, words in (({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4,
                                                "factor": 2.0}}, "rope_type 'yarn'"),
                          ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4,
                                                "factor": 8.0, "low_freq_factor": 2.0}},
                           "rope_type llama3 with .*'low_freq_factor': 2.0"),
                          ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
                          ({"mlp_bias": True}, "attention_bias False with mlp_bias True")):
        with pytest.raises(HFConversionError, match=words):
            hf_llama.args_from_hf_config({**config, **change}, "x/config.json")
    from app.checkpoint import hf
    from app.checkpoint.hf.files import pick_tokenizer
    from tests.harness.tokenizers import train_hf_tokenizer
    _, llama = _our_model(*LLAMA)
    bigger = pick_tokenizer(llama.args, {}, None, None, train_hf_tokenizer(tmp_path / "tok"))
    with pytest.raises(HFConversionError, match="has 318 tokens but the checkpoint's "
                                                "vocabulary has 60 rows"):
        hf.write_model(llama, str(tmp_path), bigger)
    assert not (tmp_path / "model.safetensors").exists()  # refused before any work
    from app.checkpoint.convert import ConvertOptions
    with pytest.raises(ValueError, match="--tokenizer-model .* and --vocab-file .* both"):
        ConvertOptions(load=str(tmp_path), save=str(tmp_path / "x"), output_format="hf",
                       tokenizer_model="tok", vocab_file="v.json", merge_file="m.txt")
    (tmp_path / "mistral").mkdir()
    (tmp_path / "mistral" / "config.json").write_text(json.dumps({"model_type": "mistral"}))
    with pytest.raises(HFConversionError, match="model_type 'mistral'"):
        hf.read_directory(str(tmp_path / "mistral"))


SPM_TEXTS = ["hello world, the quick brown fox", "jumps over the lazy dog.", "héllo ☃ wörld",
             "tabs\tand\nnewlines, <angle> brackets / slashes", "Numbers 12345 and   spaces"] * 8
SPM_STRINGS = ["hello world", "  two  spaces  ", "tab\tand\nnewline", "héllo ☃ wörld 日本",
               "ＡＢＣ ﬁ", "", " ", "▁already", "<s>x</s> y", "x<EOD>y <CLS>  z<MASK>", "<pad>"]


@pytest.fixture(scope="module")
def unigram_model(tmp_path_factory):
    """A SentencePiece Unigram model (its defaults: NFKC, dummy prefix, extra spaces removed)."""
    spm = pytest.importorskip("sentencepiece")
    path = tmp_path_factory.mktemp("spm") / "unigram.model"
    with open(path, "wb") as f:
        spm.SentencePieceTrainer.train(sentence_iterator=iter(SPM_TEXTS), model_writer=f,
                                       vocab_size=80, hard_vocab_limit=False, pad_id=3,
                                       character_coverage=1.0, minloglevel=2)
    return str(path)


def _exported_ids(out, ours, sp, strings):
    """The export's AutoTokenizer and our tokenizer give the same ids for `strings`; its
    special ids are ours, in the tokenizer, config.json and generation_config.json."""
    exported = transformers.AutoTokenizer.from_pretrained(str(out))
    for text in strings:
        assert exported(text).input_ids == ours.tokenize(text), text
    assert len(exported) == ours.vocab_size
    assert (exported.bos_token_id, exported.eos_token_id, exported.pad_token_id,
            exported.unk_token_id) == (ours.bos, ours.eod, ours.pad, sp.unk_id())
    for name in ("config.json", "generation_config.json"):
        config = json.loads((out / name).read_text())
        assert (config["bos_token_id"], config["eos_token_id"]) == (ours.bos, ours.eod), name
    assert exported.decode(ours.tokenize("hello world")) == "hello world"
    return exported


@pytest.mark.parametrize("tokenizer_type", ["GPTSentencePieceTokenizer", "SentencePieceTokenizer"])
def test_a_sentencepiece_tokenizer_travels_into_the_export(tmp_path, unigram_model,
                                                           tokenizer_type):
    """The .model the checkpoint's args name is carried (tokenizer.model + a tokenizer.json
    AutoTokenizer loads) and encodes as our tokenizer of that type: as SentencePiece itself for
    GPTSentencePieceTokenizer (literal <s> </s> <unk> text stays text), with Megatron's <CLS>
    <SEP> <EOD> <MASK> appended and split out for SentencePieceTokenizer (eos: <EOD>)."""
    import sentencepiece
    from app.checkpoint import hf
    from app.checkpoint.hf.files import pick_tokenizer
    from app.data.tokenizer import build_tokenizer
    sp = sentencepiece.SentencePieceProcessor(model_file=unigram_model)
    ours = build_tokenizer(tokenizer_type, None, None, tokenizer_model=unigram_model)
    _, source = _our_model(*LLAMA, "--tokenizer-type", tokenizer_type, "--tokenizer-model",
                           unigram_model, vocab=ours.vocab_size)
    out = tmp_path / "hf"
    out.mkdir()
    hf.write_model(source, str(out), pick_tokenizer(source.args, {}, None, None, None))
    assert (out / "tokenizer.model").read_bytes() == open(unigram_model, "rb").read()
    gpt = tokenizer_type == "GPTSentencePieceTokenizer"
    strings = SPM_STRINGS + (["the <unk> dog"] if gpt else [])  # ours: <unk> text is pieces
    exported = _exported_ids(out, ours, sp, strings)
    if gpt:
        assert exported("x </s>").input_ids == sp.encode_as_ids("x </s>")
        assert ours.eod == sp.eos_id() and len(exported) == len(sp)
    else:
        assert exported("a<EOD>b").input_ids == (sp.encode_as_ids("a") + [ours.eod]
                                                 + sp.encode_as_ids("b"))
        assert ours.eod == len(sp) + 2  # <CLS> <SEP> <EOD> <MASK> after the pieces


def test_tokenizer_model_flag_carries_a_sentencepiece_file(tmp_path, unigram_model,
                                                           monkeypatch):
    """--tokenizer-model FILE on the converter reads the .model as GPTSentencePieceTokenizer
    for a checkpoint of another type (here a GPT-2 export: its config.json's bos is the
    model's); that GPT-2 export imported and exported again keeps its tokenizer (the import
    names the directory's tokenizer.json, as the Llama import does); a missing file is one
    clear error before any work, from the flag or the args; a tokenizer.json that would encode
    otherwise than ours is refused."""
    import sentencepiece
    from app.checkpoint import hf
    from app.checkpoint.hf.files import pick_tokenizer
    from app.data.tokenizer import build_tokenizer
    sp = sentencepiece.SentencePieceProcessor(model_file=unigram_model)
    ours = build_tokenizer("GPTSentencePieceTokenizer", None, None, tokenizer_model=unigram_model)
    _, source = _our_model(vocab=ours.vocab_size)
    out = tmp_path / "hf"
    out.mkdir()
    assert hf.write_model(source, str(out), pick_tokenizer(source.args, {}, None, None,
                                                           unigram_model)) == "GPT2LMHeadModel"
    _exported_ids(out, ours, sp, SPM_STRINGS)
    import contextlib
    import io
    from tools.convert_checkpoint import main
    again = tmp_path / "again"  # the same through the command line (a GPT-2 HF source)
    assert main(["--load", str(out), "--save", str(again), "--output-format", "hf",
                 "--tokenizer-model", unigram_model]) == 0
    _exported_ids(again, ours, sp, SPM_STRINGS[:5])
    ours_dir, back = tmp_path / "ours", tmp_path / "back"  # HF -> ours -> HF keeps the tokenizer
    assert main(["--load", str(out), "--save", str(ours_dir)]) == 0
    assert main(["--load", str(ours_dir), "--save", str(back), "--output-format", "hf"]) == 0
    _exported_ids(back, ours, sp, SPM_STRINGS[:5])
    missing = tmp_path / "gone" / "tok.model"
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert main(["--load", str(out), "--save", str(tmp_path / "x"), "--output-format",
                     "hf", "--tokenizer-model", str(missing)]) == 2
    assert f"--tokenizer-model {missing} does not exist" in err.getvalue()
    assert "reading" not in err.getvalue() and not (tmp_path / "x").exists()
    source.args.tokenizer_type, source.args.tokenizer_model = "SentencePieceTokenizer", str(missing)
    with pytest.raises(FileNotFoundError, match=f"args name --tokenizer-model {missing}"):
        pick_tokenizer(source.args, {}, None, None, None)
    from app.checkpoint.hf import sentencepiece as hf_sentencepiece
    monkeypatch.setattr(hf_sentencepiece, "OUT_OF_REACH", 0.0)  # control pieces win: "<s>"
    monkeypatch.setattr(hf_sentencepiece, "PROBES", ("<s>x</s>",))
    with pytest.raises(ValueError, match="encodes '<s>x</s>' as .*, our "
                                         "GPTSentencePieceTokenizer as"):
        hf_sentencepiece.write_sentencepiece_tokenizer(str(tmp_path / "bad"), unigram_model,
                                                       "GPTSentencePieceTokenizer", 64)
