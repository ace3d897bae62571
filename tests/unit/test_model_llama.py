"""The Llama recipe (--swiglu, --normalization RMSNorm, --disable-bias-linear, --qk-layernorm,
--kv-channels, RoPE, GQA, untied output) against independent references: the plain torch
formulas of RMSNorm and SwiGLU, and Hugging Face's LlamaForCausalLM (and Qwen3ForCausalLM,
whose q_norm/k_norm are Megatron Core's qk-layernorm: RMSNorm per head before RoPE) with our
weights copied in (logits, 1e-5)."""
import pytest
import torch

from app.config import ModelConfig
from app.model import GPT2Model, fused
from app.model.mlp import glu_init

transformers = pytest.importorskip("transformers")

L, H, HEADS, GROUPS, S, V, B, FFN = 2, 32, 4, 2, 16, 96, 2, 48


def _config(**overrides) -> ModelConfig:
    kw = dict(num_layers=L, hidden_size=H, num_attention_heads=HEADS, seq_length=S,
              padded_vocab_size=V, hidden_dropout=0.0, attention_dropout=0.0, seed=7,
              swiglu=True, ffn_hidden_size=FFN, normalization="RMSNorm", add_bias_linear=False,
              position_embedding_type="rope", group_query_attention=True,
              num_query_groups=GROUPS, untie_embeddings_and_output_weights=True)
    kw.update(overrides)
    return ModelConfig(**kw)


def test_rms_norm_and_swiglu_equal_their_formulas():
    torch.manual_seed(0)
    x, w = torch.randn(3, 5, 16, dtype=torch.float64), torch.randn(16, dtype=torch.float64)
    want = x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6) * w
    torch.testing.assert_close(fused.rms_norm(x, w, 1e-6), want.to(x.dtype))
    half = fused.rms_norm(x.bfloat16(), w.float(), 1e-6)  # fp32 arithmetic, one rounding
    assert half.dtype == torch.bfloat16
    torch.testing.assert_close(half, fused.rms_norm(x.bfloat16().float(), w.float(),
                                                    1e-6).bfloat16())
    gate, up = torch.randn(4, 8, dtype=torch.float64), torch.randn(4, 8, dtype=torch.float64)
    torch.testing.assert_close(fused.swiglu(torch.cat([gate, up], -1)),
                               gate / (1 + torch.exp(-gate)) * up)
    norm = fused.norm("RMSNorm", 16, 1e-5)
    assert [n for n, _ in norm.named_parameters()] == ["weight"]


def test_swiglu_init_gives_each_rank_its_gate_and_up_shards():
    def full_init(t):
        return t.copy_(torch.arange(t.numel(), dtype=t.dtype).view_as(t))
    full = torch.empty(8, 2)
    full_init(full)  # rows 0..3 gate, 4..7 up
    stacked = glu_init(full_init, 4, 2)(torch.empty(8, 2))
    rank0, rank1 = stacked.chunk(2)
    torch.testing.assert_close(rank0, torch.cat([full[0:2], full[4:6]]))
    torch.testing.assert_close(rank1, torch.cat([full[2:4], full[6:8]]))


def test_defaults_and_parameter_counts():
    assert _config(ffn_hidden_size=None, hidden_size=96, num_attention_heads=4).ffn_hidden_size \
        == int(4 * 96 * 2 / 3 / 64) * 64  # Megatron's swiglu default: 256 -> 192
    gpt2 = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16,
                       padded_vocab_size=64)
    assert gpt2.ffn_hidden_size == 128 and gpt2.head_dim == 8 and gpt2.llama_features == []
    for cfg in (_config(), _config(qk_layernorm=True, kv_channels=16),
                _config(normalization="LayerNorm", add_bias_linear=True, swiglu=False)):
        model = GPT2Model(cfg)
        assert cfg.parameter_numels() == [p.numel() for p in model.parameters()]
    with pytest.raises(ValueError, match="--kv-channels"):
        _config(kv_channels=0)
    with pytest.raises(ValueError, match="--normalization"):
        _config(normalization="BatchNorm")
    with pytest.raises(ValueError, match="--swiglu, --normalization RMSNorm"):
        _config().require_gpt2_block("the Hugging Face GPT-2 export")


def test_gpt2_only_paths_refuse_the_llama_block(tmp_path):
    """The HF GPT-2 export (checkpoint_args_blockers) names each option GPT-2 cannot express
    (such models export as Llama); the converters' layout (Layout.of_args) and --ckpt-format
    torch_dist take them."""
    import arguments
    from app.checkpoint.hf.families.gpt2 import checkpoint_args_blockers
    from app.checkpoint.param_layout import Layout
    from app.checkpoint.model_args import checkpoint_args_namespace
    llama = ["--swiglu", "--normalization", "RMSNorm", "--disable-bias-linear", "--qk-layernorm"]
    base = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
            "--seq-length", "16", "--micro-batch-size", "2", "--train-iters", "2"]
    cfg = arguments.config_from_argv(base + llama, 1, 64)
    blockers = checkpoint_args_blockers(checkpoint_args_namespace(cfg, 0, 0, 0))
    for flag, reason in zip(["--swiglu", "--normalization RMSNorm", "--disable-bias-linear",
                             "--qk-layernorm"], blockers):
        assert reason.startswith(flag) and "export as LlamaForCausalLM" in reason
    assert Layout.of_args(checkpoint_args_namespace(cfg, 0, 0, 0), 2).config.swiglu
    torch_dist = arguments.config_from_argv(base + llama + ["--ckpt-format", "torch_dist"], 1, 64)
    assert torch_dist.checkpoint.ckpt_format == "torch_dist"


def _hf_state(ours: dict, cfg: ModelConfig, qk_norm_names=None) -> dict:
    """Our parameters under Hugging Face Llama's names and layouts."""
    hd, per_group = cfg.head_dim, HEADS // GROUPS
    state = {"model.embed_tokens.weight": ours["language_model.embedding.word_embeddings.weight"],
             "model.norm.weight": ours["language_model.transformer.final_layernorm.weight"],
             "lm_head.weight": ours["language_model.output_layer.weight"]}
    for i in range(L):
        p, q = f"language_model.transformer.layers.{i}.", f"model.layers.{i}."
        qkv = ours[p + "attention.query_key_value.weight"].view(GROUPS, per_group + 2, hd, H)
        state[q + "self_attn.q_proj.weight"] = qkv[:, :per_group].reshape(-1, H)
        state[q + "self_attn.k_proj.weight"] = qkv[:, per_group].reshape(-1, H)
        state[q + "self_attn.v_proj.weight"] = qkv[:, per_group + 1].reshape(-1, H)
        state[q + "self_attn.o_proj.weight"] = ours[p + "attention.dense.weight"]
        gate, up = ours[p + "mlp.dense_h_to_4h.weight"].chunk(2)
        state[q + "mlp.gate_proj.weight"], state[q + "mlp.up_proj.weight"] = gate, up
        state[q + "mlp.down_proj.weight"] = ours[p + "mlp.dense_4h_to_h.weight"]
        state[q + "input_layernorm.weight"] = ours[p + "input_layernorm.weight"]
        state[q + "post_attention_layernorm.weight"] = ours[p + "post_attention_layernorm.weight"]
        if cfg.qk_layernorm:
            state[q + "self_attn.q_norm.weight"] = ours[p + "attention.q_layernorm.weight"]
            state[q + "self_attn.k_norm.weight"] = ours[p + "attention.k_layernorm.weight"]
    return state


@pytest.mark.parametrize("qk_layernorm", [False, True])
def test_logits_match_hugging_face(qk_layernorm):
    cfg = _config(qk_layernorm=qk_layernorm, kv_channels=16, rotary_base=500000,
                  layernorm_epsilon=1e-6)
    ours = GPT2Model(cfg)
    with torch.no_grad():  # non-trivial norm weights, so a wrong mapping shows
        for name, param in ours.named_parameters():
            if "layernorm" in name:
                param.uniform_(0.5, 1.5)
    kind = "Qwen3" if qk_layernorm else "Llama"
    hf_config = getattr(transformers, f"{kind}Config")(
        vocab_size=V, hidden_size=H, intermediate_size=FFN, num_hidden_layers=L,
        num_attention_heads=HEADS, num_key_value_heads=GROUPS, head_dim=16,
        max_position_embeddings=S, rms_norm_eps=1e-6, attention_bias=False,
        tie_word_embeddings=False, attention_dropout=0.0,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
        attn_implementation="eager")
    hf = getattr(transformers, f"{kind}ForCausalLM")(hf_config).eval()
    copied = _hf_state({n: p.detach() for n, p in ours.named_parameters()}, cfg)
    missing, unexpected = hf.load_state_dict(copied, strict=False)
    assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)
    torch.manual_seed(0)
    tokens = torch.randint(0, V, (B, S))
    want = hf(input_ids=tokens).logits
    torch.testing.assert_close(ours(tokens), want, rtol=1e-5, atol=1e-5)


def test_rms_norm_and_swiglu_gradients_equal_autograd_of_the_formulas():
    torch.manual_seed(1)
    x = torch.randn(3, 4, 16, dtype=torch.float64, requires_grad=True)
    w = torch.randn(16, dtype=torch.float64, requires_grad=True)
    torch.autograd.gradcheck(lambda a, b: fused.rms_norm(a, b, 1e-5), (x, w))
    y = torch.randn(5, 12, dtype=torch.float64, requires_grad=True)
    torch.autograd.gradcheck(fused.swiglu, (y,))


def test_resume_is_exact_and_a_resume_without_the_options_is_refused(tmp_path):
    """Legacy format, one process: 2 steps, save, load into a fresh run, 2 more steps give the
    losses and gradient norms of 4 uninterrupted steps (bit for bit); a run without --swiglu
    is refused naming the field."""
    import arguments
    from app.checkpoint import CheckpointError
    from tests.harness.synthetic import build_synthetic_run
    base = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
            "--seq-length", "16", "--micro-batch-size", "2", "--train-iters", "4",
            "--lr", "1e-3", "--make-vocab-size-divisible-by", "8", "--distributed-backend",
            "gloo", "--hidden-dropout", "0", "--attention-dropout", "0", "--ffn-hidden-size", "64"]
    llama = ["--swiglu", "--normalization", "RMSNorm", "--disable-bias-linear", "--qk-layernorm",
             "--position-embedding-type", "rope", "--group-query-attention",
             "--num-query-groups", "2", "--untie-embeddings-and-output-weights"]

    def run():
        return build_synthetic_run(arguments.config_from_argv(base + llama, 1, 60), 16)

    whole = run()
    want = [whole["trainer"].train_step(whole["iterator"]) for _ in range(4)]
    first = run()
    for _ in range(2):
        first["trainer"].train_step(first["iterator"])
    first["engine"].save_checkpoint(str(tmp_path), 2, {"iteration": 2,
                                                       "consumed_train_samples": 4,
                                                       "consumed_valid_samples": 0})
    resumed = run()
    assert resumed["engine"].load_checkpoint(str(tmp_path)).iteration == 2
    for _ in range(2):  # the synthetic stream restarts: skip what steps 1-2 read
        next(resumed["iterator"])
    got = [resumed["trainer"].train_step(resumed["iterator"]) for _ in range(2)]
    assert [(o.loss, o.grad_norm) for o in got] == [(o.loss, o.grad_norm) for o in want[2:]]
    plain = build_synthetic_run(arguments.config_from_argv(base + llama[1:], 1, 60), 16)
    with pytest.raises(CheckpointError, match="saved with swiglu True"):
        plain["engine"].load_checkpoint(str(tmp_path))


def test_flops_count_the_gated_mlp_kv_channels_and_query_groups():
    """Megatron's formula: the MLP term 12 h f grows by 3/2 with SwiGLU (gate, up, down); the
    query width is heads x kv-channels, the key and value widths groups x kv-channels; the
    attention core is halved by the causal mask."""
    from app.training.telemetry.flops import model_flops_per_token
    gpt2 = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32,
                       padded_vocab_size=128, ffn_hidden_size=256)
    h, f, s, V = 64, 256, 32, 128
    assert model_flops_per_token(gpt2) == 2 * (24 * h * h + 12 * h * f + 6 * s * h) + 6 * h * V
    llama = _config(hidden_size=64, seq_length=32, padded_vocab_size=128, ffn_hidden_size=256,
                    kv_channels=32)
    q, kv = HEADS * 32, GROUPS * 32
    assert model_flops_per_token(llama) == (
        L * (6 * (h * (q + 2 * kv) + q * h) + 18 * h * f + 6 * s * q) + 6 * h * V)


def test_muon_and_weight_decay_treat_rms_and_qk_norms_as_norms():
    from app.optim.param_groups import get_muon_param_groups
    model = GPT2Model(_config(qk_layernorm=True))
    groups = {g["name"]: g for g in get_muon_param_groups(model, {"use_muon": True})}
    names = {id(p): n for n, p in model.named_parameters()}
    muon = {names[id(p)] for p in groups["muon"]["params"]}
    no_decay = {names[id(p)] for p in groups["no_decay"]["params"]}
    assert all("layernorm" in n for n in no_decay) and len(no_decay) == L * 4 + 1
    assert {n.split(".")[-2] for n in muon} == {"query_key_value", "dense", "dense_h_to_4h",
                                                "dense_4h_to_h"}
