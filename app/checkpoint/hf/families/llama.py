"""The Llama family's adapter: Hugging Face Llama (`LlamaForCausalLM`), Qwen2
(`Qwen2ForCausalLM`) and Qwen3 (`Qwen3ForCausalLM`) <-> our model with the Llama recipe, weight
names and layouts, config.json, and what of our model they cannot express (the directory's
files are app.checkpoint.hf.files').

Layout differences handled both ways (our full tensors are what one process holds):
- our fused QKV rows are [groups, (queries of the group, key, value), head_dim]; HF keeps
  q_proj [heads, hd], k_proj and v_proj [groups, hd] apart;
- our SwiGLU dense_h_to_4h rows are [gate; up]; HF keeps gate_proj and up_proj apart;
- HF's vocabulary is the tokenizer's; ours is padded, so rows are trimmed on export (the word
  embeddings and an untied lm_head) and padded again on import;
- Qwen3's q_norm/k_norm are Megatron Core's qk-layernorm (RMSNorm over each head's channels,
  before RoPE);
- Qwen2 is Llama with a bias on q/k/v only: --disable-bias-linear --add-qkv-bias;
- --use-rope-scaling is rope_type "llama3" (factor --rope-scaling-factor, low/high frequency
  factors 1 and 4, original context 8192: Megatron Core's fixed values);
- --apply-layernorm-1p's zero-centred gammas are written as 1 + weight (HF's RMSNorm scales by
  its weight) and read back as plain weights.
"""
from __future__ import annotations

import argparse
from typing import Dict, List, Optional

import torch

from app.checkpoint import param_layout as layout
from app.checkpoint.hf.adapter import DecoderAdapter, shift_norm_weights
from app.checkpoint.hf.files import (ExportTokenizer, HFConversionError, decoder_import_args,
                                     directory_tokenizer, read_hf_tensors)
from app.checkpoint.model_args import model_config_from_args
from app.checkpoint.state import ModelCheckpoint
from app.config import ModelConfig

LLAMA, QWEN2, QWEN3 = "LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"
MODEL_TYPES = {"llama": LLAMA, "qwen2": QWEN2, "qwen3": QWEN3}
"""config.json model_type -> the architecture this module reads and writes."""
_NORMS = (("input_layernorm", "input_layernorm"),
          ("post_attention_layernorm", "post_attention_layernorm"),
          ("attention.q_layernorm", "self_attn.q_norm"),
          ("attention.k_layernorm", "self_attn.k_norm"))
_IGNORED = (".self_attn.rotary_emb.inv_freq",)
"""Buffers of older transformers versions, not weights."""
TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")
"""config.json's special ids (default: the tokenizer's)."""
KEPT = (*TOKEN_IDS, "max_window_layers", "pretraining_tp")
LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
"""rope_type "llama3"'s settings that Megatron Core fixes (--use-rope-scaling has only a
factor)."""
"""config.json fields that do not change what the weights compute: an import keeps them in the
args (`hf_config`, a dict) and the export writes them back, so HF -> ours -> HF is exact."""


def llama_export_blockers(config: ModelConfig) -> List[str]:
    """Reasons, one per option, why `config` cannot be written as a Hugging Face Llama model
    (with --qk-layernorm: Qwen3, Llama's block with an RMSNorm over each query and key head).

    Empty when it can. Each reason names the command-line option that set it (or that is
    missing)."""
    blockers = []
    if not config.swiglu:
        blockers.append("no --swiglu: Llama's MLP is gated (silu(gate) * up)")
    if config.normalization != "RMSNorm":
        blockers.append(f"--normalization {config.normalization}: Llama's norms are RMSNorm")
    if config.position_embedding_type != "rope":
        blockers.append(f"--position-embedding-type {config.position_embedding_type}: Llama "
                        "has rotary positions only (rope)")
    elif config.rotary_percent != 1.0:
        blockers.append(f"--rotary-percent {config.rotary_percent}: Llama rotates every channel "
                        "of a head")
    if config.qk_layernorm and config.add_bias_linear:
        blockers.append("--qk-layernorm without --disable-bias-linear: Qwen3 (Llama with "
                        "query/key norms) has no MLP biases")
    if config.qk_layernorm and config.qkv_bias and not config.add_bias_linear:
        blockers.append("--qk-layernorm with --add-qkv-bias: Qwen3's attention biases include "
                        "the output projection's, and Qwen2 (QKV biases) has no query/key norms")
    if config.rotary_seq_len_interpolation_factor not in (None, 1):
        blockers.append(f"--rotary-seq-len-interpolation-factor "
                        f"{config.rotary_seq_len_interpolation_factor}: not written to "
                        "config.json's rope parameters")
    if config.moe.enabled:
        blockers.append(f"--num-experts {config.moe.num_experts}: Llama's and Qwen3's MLPs are "
                        "dense (a Mixture-of-Experts model exports as Qwen3-MoE, Mixtral or "
                        "Qwen2-MoE)")
    return blockers


def to_hf_state(ours: Dict[str, torch.Tensor], config: ModelConfig,
                vocab_size: Optional[int] = None) -> Dict[str, torch.Tensor]:
    """Our full tensors (our names) -> HF Llama/Qwen2/Qwen3 names and layouts (1 + the
    zero-centred norm weights of --apply-layernorm-1p); `vocab_size` trims the vocabulary rows
    (None keeps them all). The MLPs of a Mixture-of-Experts model's MoE layers are left to its
    family (app.checkpoint.hf.moe)."""
    rows = slice(None, vocab_size)
    ours = shift_norm_weights(ours, 1.0 if config.layernorm_zero_centered_gamma else 0.0)
    moe_layers = config.moe.layer_pattern(config.num_layers)
    out = {"model.embed_tokens.weight": ours[layout.WORD_EMBEDDINGS][rows],
           "model.norm.weight": ours[layout.FINAL_NORM[0]]}
    if config.untie_embeddings_and_output_weights:
        out["lm_head.weight"] = ours[layout.OUTPUT_LAYER][rows]
    for i in range(config.num_layers):
        mine = lambda suffix: ours.get(layout.layer_param_name(i, suffix))  # noqa: E731
        hf = f"model.layers.{i}."
        for ours_name, hf_name in _NORMS:
            if mine(f"{ours_name}.weight") is not None:
                out[f"{hf}{hf_name}.weight"] = mine(f"{ours_name}.weight")
        for kind in linear_tensors(config.qkv_bias):
            q, k, v = split_qkv(mine(f"attention.query_key_value.{kind}"), config)
            out.update({f"{hf}self_attn.q_proj.{kind}": q, f"{hf}self_attn.k_proj.{kind}": k,
                        f"{hf}self_attn.v_proj.{kind}": v})
        for kind in linear_tensors(config.add_bias_linear):
            out[f"{hf}self_attn.o_proj.{kind}"] = mine(f"attention.dense.{kind}")
            if moe_layers[i]:
                continue
            gate, up = mine(f"mlp.dense_h_to_4h.{kind}").chunk(2)
            out.update({f"{hf}mlp.gate_proj.{kind}": gate, f"{hf}mlp.up_proj.{kind}": up,
                        f"{hf}mlp.down_proj.{kind}": mine(f"mlp.dense_4h_to_h.{kind}")})
    return out


def from_hf_state(hf: Dict[str, torch.Tensor], config: ModelConfig) -> Dict[str, torch.Tensor]:
    """HF Llama/Qwen2/Qwen3 tensors -> our names and layouts; inverse of to_hf_state (the vocabulary
    keeps HF's rows: pad it afterwards; an MoE model's MoE layers take no dense MLP: their
    family reads those). A missing or unknown key, or a tied lm_head that differs from the
    embeddings, raises HFConversionError naming the key."""
    state = {k: v for k, v in hf.items() if not k.endswith(_IGNORED)}
    moe_layers = config.moe.layer_pattern(config.num_layers)
    ours = take_outer(state, config)
    for i in range(config.num_layers):
        hf_name = lambda suffix: f"model.layers.{i}.{suffix}"  # noqa: E731
        name = lambda suffix: layout.layer_param_name(i, suffix)  # noqa: E731
        for ours_name, theirs in _NORMS[:4 if config.qk_layernorm else 2]:
            ours[name(f"{ours_name}.weight")] = take(state, hf_name(f"{theirs}.weight"))
        for kind in linear_tensors(config.qkv_bias):
            q, k, v = (take(state, hf_name(f"self_attn.{p}_proj.{kind}")) for p in "qkv")
            ours[name(f"attention.query_key_value.{kind}")] = fuse_qkv(q, k, v, config)
        for kind in linear_tensors(config.add_bias_linear):
            ours[name(f"attention.dense.{kind}")] = take(state,
                                                          hf_name(f"self_attn.o_proj.{kind}"))
            if moe_layers[i]:
                continue
            ours[name(f"mlp.dense_h_to_4h.{kind}")] = torch.cat(
                [take(state, hf_name(f"mlp.{p}_proj.{kind}")) for p in ("gate", "up")])
            ours[name(f"mlp.dense_4h_to_h.{kind}")] = take(state, hf_name(f"mlp.down_proj.{kind}"))
    if state:
        raise HFConversionError(f"Hugging Face key {sorted(state)[0]!r} cannot be mapped to a "
                                f"Llama model with {config.num_layers} layers (config.json "
                                "num_hidden_layers, attention_bias, mlp_bias)")
    return ours


def take_outer(state: Dict[str, torch.Tensor], config: ModelConfig, norm_bias: bool = False
               ) -> Dict[str, torch.Tensor]:
    """Take the tensors outside the layers from a decoder's HF `state` (model.embed_tokens,
    model.norm: its weight, and its bias with `norm_bias`, lm_head) under our names; a tied
    lm_head that differs from the embeddings raises HFConversionError."""
    ours = {layout.WORD_EMBEDDINGS: take(state, "model.embed_tokens.weight"),
            layout.FINAL_NORM[0]: take(state, "model.norm.weight")}
    if norm_bias:
        ours[layout.FINAL_NORM[1]] = take(state, "model.norm.bias")
    if config.untie_embeddings_and_output_weights:
        ours[layout.OUTPUT_LAYER] = take(state, "lm_head.weight")
    elif "lm_head.weight" in state and not torch.equal(state.pop("lm_head.weight"),
                                                       ours[layout.WORD_EMBEDDINGS]):
        raise HFConversionError("lm_head.weight differs from model.embed_tokens.weight but "
                                "config.json says tie_word_embeddings=true")
    return ours


def linear_tensors(bias: bool):
    """The tensors of a linear layer: its weight, and its bias when it has one."""
    return ("weight", "bias") if bias else ("weight",)


def split_qkv(t: torch.Tensor, config: ModelConfig):
    """Our fused QKV rows [groups, (per_group q, k, v), hd, ...] -> q [heads hd, ...],
    k and v [groups hd, ...]."""
    groups, hd = config.num_kv_heads, config.head_dim
    per_group = config.num_attention_heads // groups
    grouped = t.reshape(groups, per_group + 2, hd, *t.shape[1:])
    flat = lambda x: x.reshape(-1, *t.shape[1:])  # noqa: E731
    return (flat(grouped[:, :per_group]), flat(grouped[:, per_group]),
            flat(grouped[:, per_group + 1]))


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, config: ModelConfig
              ) -> torch.Tensor:
    """Inverse of split_qkv."""
    groups, hd = config.num_kv_heads, config.head_dim
    per_group = config.num_attention_heads // groups
    rest = tuple(q.shape[1:])
    fused = torch.cat([q.reshape(groups, per_group, hd, *rest), k.reshape(groups, 1, hd, *rest),
                       v.reshape(groups, 1, hd, *rest)], dim=1)  # [groups, per_group + 2, hd, ...]
    return fused.reshape(-1, *rest)


def take(state: Dict[str, torch.Tensor], key: str) -> torch.Tensor:
    """Remove and return `state[key]`; HFConversionError naming a missing key."""
    if key not in state:
        raise HFConversionError(f"Hugging Face checkpoint has no {key!r}")
    return state.pop(key)


# ---------------------------------------------------------------------------- config

def hf_config(args: argparse.Namespace, config: ModelConfig, architecture: str,
              dtype: torch.dtype, vocab_size: int, tokenizer: ExportTokenizer) -> Dict:
    """config.json of `architecture` (LLAMA, QWEN2 or QWEN3) for the model `config` (its
    Megatron `args` give the rest); the special ids are the ones an import kept in `args`, else
    the tokenizer's."""
    theta = float(config.rotary_base)
    rope = {"rope_type": "default", "rope_theta": theta}
    if config.use_rope_scaling:
        rope = {"rope_type": "llama3", "rope_theta": theta,
                "factor": float(config.rope_scaling_factor), **LLAMA3_ROPE}
    out = {
        "architectures": [architecture],
        "model_type": next(t for t, a in MODEL_TYPES.items() if a == architecture),
        "vocab_size": vocab_size, "hidden_size": config.hidden_size,
        "intermediate_size": config.ffn_hidden_size, "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_kv_heads, "head_dim": config.head_dim,
        "hidden_act": "silu", "max_position_embeddings": config.max_position_embeddings,
        "initializer_range": float(getattr(args, "init_method_std", 0.02)),
        "rms_norm_eps": config.layernorm_epsilon, "use_cache": True,
        "tie_word_embeddings": not config.untie_embeddings_and_output_weights,
        "rope_theta": theta, "rope_parameters": rope,
        "rope_scaling": rope if config.use_rope_scaling else None,
        "attention_dropout": float(getattr(args, "attention_dropout", 0.0)),
        "dtype": str(dtype).replace("torch.", "")}
    defaults = {"bos_token_id": tokenizer.bos, "eos_token_id": tokenizer.eos,
                "pad_token_id": tokenizer.pad}
    if architecture != QWEN2:  # Qwen2's biases are fixed: q/k/v only
        out["attention_bias"] = config.add_bias_linear
    if architecture == LLAMA:
        out.update(mlp_bias=config.add_bias_linear)
        defaults["pretraining_tp"] = 1
    else:
        out.update(use_sliding_window=False, sliding_window=None,
                   layer_types=["full_attention"] * config.num_layers)
        defaults["max_window_layers"] = config.num_layers
    kept = getattr(args, "hf_config", None) or {}
    out.update({key: kept.get(key, default) for key, default in defaults.items()})
    return out


def rope_settings(config: Dict, path: str) -> Dict[str, object]:
    """The RoPE args of a config.json (transformers 5's rope_parameters, or the older rope_theta
    and rope_scaling): rotary_base, and use_rope_scaling / rope_scaling_factor for rope_type
    "llama3" with Megatron Core's fixed frequency factors; HFConversionError for another RoPE
    scaling (which our RoPE does not compute)."""
    params = {**(config.get("rope_scaling") or {}), **(config.get("rope_parameters") or {})}
    kind = params.get("rope_type") or params.get("type") or "default"
    theta = float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
    if not theta.is_integer():
        raise HFConversionError(f"{path}: rope_theta {theta} is not a whole number "
                                "(--rotary-base takes an integer)")
    out: Dict[str, object] = {"rotary_base": int(theta), "use_rope_scaling": kind == "llama3"}
    if kind == "llama3":
        fixed = {key: float(params.get(key, value)) for key, value in LLAMA3_ROPE.items()}
        if fixed != LLAMA3_ROPE or "factor" not in params:
            raise HFConversionError(f"{path}: rope_type llama3 with {fixed} and factor "
                                    f"{params.get('factor')} is not supported: Megatron's "
                                    f"--use-rope-scaling takes a factor and fixes {LLAMA3_ROPE}")
        out["rope_scaling_factor"] = float(params["factor"])
    elif kind != "default":
        raise HFConversionError(f"{path}: rope_type {kind!r} (RoPE scaling) is not supported; "
                                "Megatron's RoPE is the default one or llama3's "
                                "(--use-rope-scaling)")
    return out


def args_from_hf_config(config: Dict, path: str, make_vocab_size_divisible_by: int = 128,
                        tokenizer_model: Optional[str] = None) -> argparse.Namespace:
    """Megatron args of a Llama, Qwen2 or Qwen3 config.json (`tokenizer_model`: the directory
    holding its tokenizer, None when it has none)."""
    kind = config.get("model_type")
    for key, value, fine in (("hidden_act", config.get("hidden_act", "silu"), "silu"),
                             ("use_sliding_window", config.get("use_sliding_window"), False)):
        if value not in (fine, None):
            raise HFConversionError(f"{path}: {key} {value!r} is not supported (Megatron's "
                                    f"Llama recipe: {key} {fine!r})")
    biases = (bool(config.get("attention_bias", False)),  # Qwen3's MLP has none
              bool(config.get("mlp_bias", False)) if kind == "llama" else False)
    if kind == "qwen2":  # q/k/v biases only, whatever the config says
        biases = (False, False)
    if biases[0] != biases[1]:
        raise HFConversionError(f"{path}: attention_bias {biases[0]} with mlp_bias {biases[1]} "
                                "is not supported: --disable-bias-linear drops the biases of "
                                "both (the attention and the MLP) or neither")
    return decoder_import_args(
        config, 2048, make_vocab_size_divisible_by, tokenizer_model,
        layernorm_epsilon=float(config.get("rms_norm_eps", 1e-6)),
        swiglu=True, normalization="RMSNorm", qk_layernorm=kind == "qwen3",
        add_bias_linear=biases[0], add_qkv_bias=biases[0] or kind == "qwen2",
        rotary_percent=1.0, **rope_settings(config, path),
        hf_config={key: config[key] for key in KEPT if key in config})


# ---------------------------------------------------------------------------- directories

def read_hf_dir(path: str, config: Dict, make_vocab_size_divisible_by: int = 128
                ) -> ModelCheckpoint:
    """A `save_pretrained` Llama, Qwen2 or Qwen3 directory whose config.json is `config` (its
    tokenizer, when it has one, is named in the args as the run's --tokenizer-model)."""
    args = args_from_hf_config(config, f"{path}/config.json", make_vocab_size_divisible_by,
                               directory_tokenizer(path))
    model = model_config_from_args(args, for_inference=True)
    weights = from_hf_state(read_hf_tensors(path), model)
    args.params_dtype = weights[layout.WORD_EMBEDDINGS].dtype
    return ModelCheckpoint(args=args, weights=weights)


class LlamaAdapter(DecoderAdapter):
    """Hugging Face Llama, Qwen2 (Llama's block with q/k/v biases: --disable-bias-linear
    --add-qkv-bias) and Qwen3 (Llama's block with query/key norms: --qk-layernorm)."""

    family = "Llama"
    model_types = MODEL_TYPES
    export_order = 10

    def export_blockers(self, config: ModelConfig) -> List[str]:
        return llama_export_blockers(config)

    def export_architecture(self, config: ModelConfig) -> str:
        if config.qk_layernorm:
            return QWEN3
        return QWEN2 if config.qkv_bias and not config.add_bias_linear else LLAMA

    read_directory = staticmethod(read_hf_dir)

    def hf_tensors(self, weights: Dict[str, torch.Tensor], config: ModelConfig,
                   vocab_size: int) -> Dict[str, torch.Tensor]:
        return to_hf_state(weights, config, vocab_size)

    def hf_config_json(self, args: argparse.Namespace, config: ModelConfig, dtype: torch.dtype,
                       vocab_size: int, tokenizer: ExportTokenizer) -> Dict:
        return hf_config(args, config, self.export_architecture(config), dtype, vocab_size,
                         tokenizer)


ADAPTER = LlamaAdapter()
