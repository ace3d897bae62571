"""Hugging Face Mixture-of-Experts families both ways (app/checkpoint/hf/families/qwen3_moe.py,
mixtral.py, qwen2_moe.py on app.checkpoint.hf.moe), against transformers' own classes:

- a tiny Qwen3MoeForCausalLM (a dense first layer: mlp_only_layers, renormalised top-k) and a
  MixtralForCausalLM, random and saved by transformers' save_pretrained (per-expert tensors, as
  the Hub holds them; Mixtral also in transformers 5's fused in-memory names), import into our
  legacy format at expert-parallel size 2, give transformers' logits (1e-5), train, and export
  back: the untrained round trip gives every tensor and config.json field back, the trained
  export gives the trained model's logits;
- our MoE models export as the family that expresses them (Qwen3-MoE with a dense layer and with
  --moe-router-pre-softmax, i.e. norm_topk_prob false; Mixtral), load into transformers' class
  with no missing or unexpected weight and give our logits (1e-5), with Megatron's MoE layers
  written as Hugging Face counts them (decoder_sparse_step 1, mlp_only_layers);
- what no family expresses is refused by name.
"""
import json
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")

L, H, HEADS, GROUPS, HD, FFN, E, MOE_FFN = 3, 32, 4, 2, 8, 64, 4, 16
VOCAB = 320  # the test tokenizer's 318 tokens, padded to 8 (tests.harness.tokenizers)
TOKENS = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(3))


def _hf_model(family, **extra):
    """A random transformers model of `family`, routers decisive and norms away from 1."""
    common = dict(vocab_size=VOCAB, hidden_size=H, num_hidden_layers=L, num_attention_heads=HEADS,
                  num_key_value_heads=GROUPS, head_dim=HD, max_position_embeddings=32,
                  num_experts_per_tok=2, tie_word_embeddings=False,
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    if family == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(**common, intermediate_size=FFN, num_experts=E,
                                             moe_intermediate_size=MOE_FFN, mlp_only_layers=[0],
                                             norm_topk_prob=True, **extra)
        model = transformers.Qwen3MoeForCausalLM(config)
    else:
        config = transformers.MixtralConfig(**common, intermediate_size=MOE_FFN,
                                            num_local_experts=E, **extra)
        model = transformers.MixtralForCausalLM(config)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
            elif name.endswith("gate.weight"):  # the routers
                param.normal_(0.0, 1.0)
    return model.eval()


def _flags(family):
    """Our flags of the model `_hf_model(family)` is."""
    flags = ["--num-layers", str(L), "--hidden-size", str(H), "--num-attention-heads", str(HEADS),
             "--seq-length", "16", "--max-position-embeddings", "32", "--micro-batch-size", "2",
             "--global-batch-size", "4", "--train-iters", "3", "--lr", "1e-2",
             "--hidden-dropout", "0", "--attention-dropout", "0",
             "--make-vocab-size-divisible-by", "8", "--swiglu", "--normalization", "RMSNorm",
             "--disable-bias-linear", "--position-embedding-type", "rope",
             "--group-query-attention", "--num-query-groups", str(GROUPS), "--kv-channels",
             str(HD), "--untie-embeddings-and-output-weights", "--num-experts", str(E),
             "--moe-ffn-hidden-size", str(MOE_FFN), "--moe-router-topk", "2"]
    if family == "qwen3_moe":
        return flags + ["--qk-layernorm", "--norm-epsilon", "1e-6", "--ffn-hidden-size", str(FFN),
                        "--moe-layer-freq", "([0]+[1]*2)", "--moe-aux-loss-coeff", "1e-3"]
    return flags + ["--norm-epsilon", "1e-5", "--ffn-hidden-size", str(MOE_FFN),
                    "--moe-aux-loss-coeff", "1e-3"]


def _convert(**options):
    from app.checkpoint.convert import ConvertOptions, convert
    return convert(ConvertOptions(**{k: str(v) if isinstance(v, os.PathLike) else v
                                     for k, v in options.items()}))


def _tensors(path):
    from app.checkpoint.hf.files import read_hf_tensors
    return read_hf_tensors(str(path))


def _config(path):
    keep = transformers.AutoConfig.from_pretrained(str(path)).to_dict()
    return {k: v for k, v in keep.items() if k not in ("transformers_version", "_name_or_path")}


def _our_logits(run):
    model = run["model"].eval()
    with torch.no_grad():
        return model(TOKENS, torch.arange(TOKENS.shape[1]).expand_as(TOKENS))[..., :VOCAB]


@pytest.mark.parametrize("family, fused", [("qwen3_moe", False), ("mixtral", False),
                                           ("mixtral", True)])
def test_transformers_saved_models_import_give_their_logits_train_and_go_back(
        tmp_path, family, fused):
    import arguments
    from tests.harness.synthetic import build_synthetic_run, train_steps
    from tests.harness.tokenizers import train_hf_tokenizer
    reference = _hf_model(family)
    source, ours, back = tmp_path / "source", tmp_path / "ours", tmp_path / "back"
    reference.save_pretrained(str(source), save_original_format=not fused)
    train_hf_tokenizer(source)
    names = _tensors(source)
    assert any(".experts.gate_up_proj" in n for n in names) == fused
    _convert(load=source, save=ours, target_expert_model_parallel_size=2,
             make_vocab_size_divisible_by=8)
    assert sorted(os.listdir(ours / "release")) == ["mp_rank_00_000", "mp_rank_00_001"]
    if not fused:  # the untrained round trip gives back what transformers wrote
        _convert(load=ours, save=back, output_format="hf")
        got = _tensors(back)
        assert sorted(got) == sorted(names)
        assert all(torch.equal(got[n], t) for n, t in names.items())
        assert _config(back) == _config(source)
    run = build_synthetic_run(arguments.config_from_argv(
        _flags(family) + ["--load", str(ours), "--finetune", "--tokenizer-type",
                          "HuggingFaceTokenizer", "--tokenizer-model", str(source)], 1, VOCAB), 64)
    run["engine"].load_checkpoint(str(ours))
    with torch.no_grad():
        theirs = reference(input_ids=TOKENS).logits
    torch.testing.assert_close(_our_logits(run), theirs, rtol=1e-5, atol=1e-5)
    before = {n: p.detach().clone() for n, p in run["model"].named_parameters()}
    losses = [loss for loss, _ in train_steps(run, 3)]
    assert all(torch.isfinite(torch.tensor(losses))), losses
    moved = [n for n, p in run["model"].named_parameters() if not torch.equal(p, before[n])]
    assert any("experts.dense_h_to_4h" in n for n in moved) and any("router" in n for n in moved)
    trained = tmp_path / "trained"
    run["engine"].save_checkpoint(str(trained), 3, dict(iteration=3, consumed_train_samples=12,
                                                        consumed_valid_samples=0))
    _convert(load=trained, save=tmp_path / "trained_hf", output_format="hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "trained_hf")).eval()
    with torch.no_grad():
        torch.testing.assert_close(hf(input_ids=TOKENS).logits, _our_logits(run), rtol=1e-5,
                                   atol=1e-5)


def _our_model(*flags):
    """Our model (one process, routers decisive, norms away from 1) and its checkpoint."""
    import arguments
    from app.checkpoint.model_args import checkpoint_args_namespace
    from app.checkpoint.state import ModelCheckpoint
    from app.model import GPT2Model
    cfg = arguments.config_from_argv(list(flags), 1, VOCAB)
    torch.manual_seed(1)
    model = GPT2Model(cfg.model).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "layernorm" in name:
                param.uniform_(0.5, 1.5)
            elif name.endswith("router.weight"):
                param.normal_(0.0, 1.0)
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    return model, ModelCheckpoint(args=checkpoint_args_namespace(cfg, 0, 0, 0), weights=weights)


@pytest.mark.parametrize("family, extra, architecture, mlp_only, norm_topk", [
    ("qwen3_moe", [], "Qwen3MoeForCausalLM", [0], True),
    ("qwen3_moe", ["--moe-router-pre-softmax", "--moe-layer-freq", "1"], "Qwen3MoeForCausalLM",
     [], False),
    ("mixtral", [], "MixtralForCausalLM", None, None)])
def test_our_moe_models_export_as_their_family_with_our_logits(tmp_path, family, extra,
                                                               architecture, mlp_only, norm_topk):
    from app.checkpoint import hf
    model, source = _our_model(*_flags(family), *extra)
    assert hf.write_model(source, str(tmp_path)) == architecture
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == [architecture]
    assert (config["num_local_experts"], config["num_experts_per_tok"],
            config["router_aux_loss_coef"]) == (E, 2, 1e-3)
    if family == "qwen3_moe":
        assert (config["num_experts"], config["moe_intermediate_size"],
                config["intermediate_size"], config["decoder_sparse_step"],
                config["mlp_only_layers"], config["norm_topk_prob"]) == (
                    E, MOE_FFN, FFN, 1, mlp_only, norm_topk)
    else:
        assert config["intermediate_size"] == MOE_FFN and "mlp_only_layers" not in config
    theirs, info = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path),
                                                                    output_loading_info=True)
    assert type(theirs).__name__ == architecture
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    with torch.no_grad():
        ours = model(TOKENS, torch.arange(TOKENS.shape[1]).expand_as(TOKENS))[..., :VOCAB]
        torch.testing.assert_close(theirs.eval()(input_ids=TOKENS).logits, ours, rtol=1e-5,
                                   atol=1e-5)


def test_what_no_family_expresses_is_refused_by_name(tmp_path):
    from app.checkpoint.hf import export_architecture
    from app.checkpoint.hf.files import HFConversionError
    from app.checkpoint.hf.families.mixtral import ADAPTER as MIXTRAL
    from app.checkpoint.model_args import model_config_from_args
    base = [f for f in _flags("qwen3_moe") if f != "--qk-layernorm"]  # a dense layer, no QK-norm
    _, plain = _our_model(*base)
    with pytest.raises(ValueError) as refused:
        export_architecture(model_config_from_args(plain.args, for_inference=True))
    message = str(refused.value)
    for words in ("Llama model (it uses", "--num-experts 4: Llama's and Qwen3's MLPs are dense",
                  "Qwen3-MoE model (it uses --qk-layernorm: Qwen3-MoE has query/key norms",
                  "Mixtral model (it uses --moe-layer-freq [0, 1, 1]: every Mixtral layer is an "
                  "MoE layer", "Qwen2-MoE model (it uses", "Qwen2-MoE has a shared expert"):
        assert words in message, message
    _, sigmoid = _our_model(*_flags("mixtral"), "--moe-router-score-function", "sigmoid")
    with pytest.raises(ValueError, match="--moe-router-score-function sigmoid: Hugging Face's "
                                         "MoE routers take a softmax"):
        export_architecture(model_config_from_args(sigmoid.args, for_inference=True))
    config = _hf_model("mixtral").config.to_dict()
    with pytest.raises(HFConversionError, match="router_jitter_noise 0.1 is not supported"):
        MIXTRAL.import_fields({**config, "router_jitter_noise": 0.1}, "x/config.json")
