"""The Llama family's adapter: Hugging Face Llama (`LlamaForCausalLM`) and Qwen3
(`Qwen3ForCausalLM`) <-> our model with the Llama recipe, weight names and layouts, config.json,
and what of our model Llama cannot express (the directory's files are app.checkpoint.hf.files').

Layout differences handled both ways (our full tensors are what one process holds):
- our fused QKV rows are [groups, (queries of the group, key, value), head_dim]; HF keeps
  q_proj [heads, hd], k_proj and v_proj [groups, hd] apart;
- our SwiGLU dense_h_to_4h rows are [gate; up]; HF keeps gate_proj and up_proj apart;
- HF's vocabulary is the tokenizer's; ours is padded, so rows are trimmed on export (the word
  embeddings and an untied lm_head) and padded again on import;
- Qwen3's q_norm/k_norm are Megatron Core's qk-layernorm (RMSNorm over each head's channels,
  before RoPE).
"""
from __future__ import annotations

import argparse
from typing import Dict, List, Optional

import torch

from app.checkpoint import param_layout as layout
from app.checkpoint.hf.adapter import FamilyAdapter
from app.checkpoint.hf.files import (ExportTokenizer, HFConversionError, directory_tokenizer,
                                     import_args, read_hf_tensors, write_directory)
from app.checkpoint.model_args import model_config_from_args
from app.checkpoint.state import ModelCheckpoint
from app.config import ModelConfig

LLAMA, QWEN3 = "LlamaForCausalLM", "Qwen3ForCausalLM"
MODEL_TYPES = {"llama": LLAMA, "qwen3": QWEN3}
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
    if config.moe.enabled:
        blockers.append(f"--num-experts {config.moe.num_experts}: Llama's and Qwen3's MLPs are "
                        "dense (a Mixture-of-Experts model exports as Qwen3-MoE, Mixtral or "
                        "Qwen2-MoE)")
    return blockers


def to_hf_state(ours: Dict[str, torch.Tensor], config: ModelConfig,
                vocab_size: Optional[int] = None) -> Dict[str, torch.Tensor]:
    """Our full tensors (our names) -> HF Llama/Qwen3 names and layouts; `vocab_size` trims the
    vocabulary rows (None keeps them all). The MLPs of a Mixture-of-Experts model's MoE layers
    are left to its family (app.checkpoint.hf.moe)."""
    rows = slice(None, vocab_size)
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
        for kind in ("weight", "bias") if config.add_bias_linear else ("weight",):
            q, k, v = _split_qkv(mine(f"attention.query_key_value.{kind}"), config)
            out.update({f"{hf}self_attn.q_proj.{kind}": q, f"{hf}self_attn.k_proj.{kind}": k,
                        f"{hf}self_attn.v_proj.{kind}": v,
                        f"{hf}self_attn.o_proj.{kind}": mine(f"attention.dense.{kind}")})
            if moe_layers[i]:
                continue
            gate, up = mine(f"mlp.dense_h_to_4h.{kind}").chunk(2)
            out.update({f"{hf}mlp.gate_proj.{kind}": gate, f"{hf}mlp.up_proj.{kind}": up,
                        f"{hf}mlp.down_proj.{kind}": mine(f"mlp.dense_4h_to_h.{kind}")})
    return out


def from_hf_state(hf: Dict[str, torch.Tensor], config: ModelConfig) -> Dict[str, torch.Tensor]:
    """HF Llama/Qwen3 tensors -> our names and layouts; inverse of to_hf_state (the vocabulary
    keeps HF's rows: pad it afterwards; an MoE model's MoE layers take no dense MLP: their
    family reads those). A missing or unknown key, or a tied lm_head that differs from the
    embeddings, raises HFConversionError naming the key."""
    state = {k: v for k, v in hf.items() if not k.endswith(_IGNORED)}
    moe_layers = config.moe.layer_pattern(config.num_layers)
    ours = {layout.WORD_EMBEDDINGS: _take(state, "model.embed_tokens.weight"),
            layout.FINAL_NORM[0]: _take(state, "model.norm.weight")}
    if config.untie_embeddings_and_output_weights:
        ours[layout.OUTPUT_LAYER] = _take(state, "lm_head.weight")
    elif "lm_head.weight" in state and not torch.equal(state.pop("lm_head.weight"),
                                                       ours[layout.WORD_EMBEDDINGS]):
        raise HFConversionError("lm_head.weight differs from model.embed_tokens.weight but "
                                "config.json says tie_word_embeddings=true")
    for i in range(config.num_layers):
        hf_name = lambda suffix: f"model.layers.{i}.{suffix}"  # noqa: E731
        name = lambda suffix: layout.layer_param_name(i, suffix)  # noqa: E731
        for ours_name, theirs in _NORMS[:4 if config.qk_layernorm else 2]:
            ours[name(f"{ours_name}.weight")] = _take(state, hf_name(f"{theirs}.weight"))
        for kind in ("weight", "bias") if config.add_bias_linear else ("weight",):
            q, k, v = (_take(state, hf_name(f"self_attn.{p}_proj.{kind}")) for p in "qkv")
            ours[name(f"attention.query_key_value.{kind}")] = _fuse_qkv(q, k, v, config)
            ours[name(f"attention.dense.{kind}")] = _take(state,
                                                          hf_name(f"self_attn.o_proj.{kind}"))
            if moe_layers[i]:
                continue
            ours[name(f"mlp.dense_h_to_4h.{kind}")] = torch.cat(
                [_take(state, hf_name(f"mlp.{p}_proj.{kind}")) for p in ("gate", "up")])
            ours[name(f"mlp.dense_4h_to_h.{kind}")] = _take(state, hf_name(f"mlp.down_proj.{kind}"))
    if state:
        raise HFConversionError(f"Hugging Face key {sorted(state)[0]!r} cannot be mapped to a "
                                f"Llama model with {config.num_layers} layers (config.json "
                                "num_hidden_layers, attention_bias, mlp_bias)")
    return ours


def _split_qkv(t: torch.Tensor, config: ModelConfig):
    """Our fused QKV rows [groups, (per_group q, k, v), hd, ...] -> q [heads hd, ...],
    k and v [groups hd, ...]."""
    groups, hd = config.num_kv_heads, config.head_dim
    per_group = config.num_attention_heads // groups
    grouped = t.reshape(groups, per_group + 2, hd, *t.shape[1:])
    flat = lambda x: x.reshape(-1, *t.shape[1:])  # noqa: E731
    return (flat(grouped[:, :per_group]), flat(grouped[:, per_group]),
            flat(grouped[:, per_group + 1]))


def _fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, config: ModelConfig
              ) -> torch.Tensor:
    """Inverse of _split_qkv."""
    groups, hd = config.num_kv_heads, config.head_dim
    per_group = config.num_attention_heads // groups
    rest = tuple(q.shape[1:])
    fused = torch.cat([q.reshape(groups, per_group, hd, *rest), k.reshape(groups, 1, hd, *rest),
                       v.reshape(groups, 1, hd, *rest)], dim=1)  # [groups, per_group + 2, hd, ...]
    return fused.reshape(-1, *rest)


def _take(state: Dict[str, torch.Tensor], key: str) -> torch.Tensor:
    if key not in state:
        raise HFConversionError(f"Hugging Face checkpoint has no {key!r}")
    return state.pop(key)


# ---------------------------------------------------------------------------- config

def hf_config(args: argparse.Namespace, config: ModelConfig, architecture: str,
              dtype: torch.dtype, vocab_size: int, tokenizer: ExportTokenizer) -> Dict:
    """config.json of `architecture` (LLAMA or QWEN3) for the model `config` (its Megatron
    `args` give the rest); the special ids are the ones an import kept in `args`, else the
    tokenizer's."""
    theta = float(config.rotary_base)
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
        "rope_theta": theta, "rope_parameters": {"rope_type": "default", "rope_theta": theta},
        "rope_scaling": None, "attention_bias": config.add_bias_linear,
        "attention_dropout": float(getattr(args, "attention_dropout", 0.0)),
        "dtype": str(dtype).replace("torch.", "")}
    defaults = {"bos_token_id": tokenizer.bos, "eos_token_id": tokenizer.eos,
                "pad_token_id": tokenizer.pad}
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


def _rope_theta(config: Dict, path: str) -> float:
    """The RoPE base of a Llama/Qwen3 config.json (transformers 5's rope_parameters or the older
    rope_theta); HFConversionError for a RoPE scaling our RoPE does not compute."""
    params = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling") or {}
    kind = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if kind != "default":
        raise HFConversionError(f"{path}: rope_type {kind!r} (RoPE scaling) is not supported; "
                                "Megatron's --position-embedding-type rope is the default RoPE")
    theta = float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
    if not theta.is_integer():
        raise HFConversionError(f"{path}: rope_theta {theta} is not a whole number "
                                "(--rotary-base takes an integer)")
    return theta


def args_from_hf_config(config: Dict, path: str, make_vocab_size_divisible_by: int = 128,
                        tokenizer_model: Optional[str] = None) -> argparse.Namespace:
    """Megatron args of a Llama or Qwen3 config.json (`tokenizer_model`: the directory holding
    its tokenizer, None when it has none)."""
    kind = config.get("model_type")
    for key, value, fine in (("hidden_act", config.get("hidden_act", "silu"), "silu"),
                             ("use_sliding_window", config.get("use_sliding_window"), False)):
        if value not in (fine, None):
            raise HFConversionError(f"{path}: {key} {value!r} is not supported (Megatron's "
                                    f"Llama recipe: {key} {fine!r})")
    biases = (bool(config.get("attention_bias", False)),  # Qwen3's MLP has none
              bool(config.get("mlp_bias", False)) if kind == "llama" else False)
    if biases[0] != biases[1]:
        raise HFConversionError(f"{path}: attention_bias {biases[0]} with mlp_bias {biases[1]} "
                                "is not supported: --disable-bias-linear drops the biases of "
                                "both (the attention and the MLP) or neither")
    hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    positions = int(config.get("max_position_embeddings", 2048))
    vocab = int(config["vocab_size"])
    return import_args(
        num_layers=int(config["num_hidden_layers"]), hidden_size=hidden,
        num_attention_heads=heads, ffn_hidden_size=int(config["intermediate_size"]),
        kv_channels=int(config.get("head_dim") or hidden // heads),
        max_position_embeddings=positions, seq_length=positions, vocab_size=vocab,
        make_vocab_size_divisible_by=make_vocab_size_divisible_by, padded_vocab_size=vocab,
        tokenizer_type="HuggingFaceTokenizer", tokenizer_model=tokenizer_model,
        layernorm_epsilon=float(config.get("rms_norm_eps", 1e-6)),
        hidden_dropout=0.0, attention_dropout=float(config.get("attention_dropout", 0.0)),
        init_method_std=float(config.get("initializer_range", 0.02)),
        swiglu=True, normalization="RMSNorm", qk_layernorm=kind == "qwen3",
        add_bias_linear=biases[0],
        position_embedding_type="rope", use_rotary_position_embeddings=True,
        add_position_embedding=False, rotary_percent=1.0,
        rotary_base=int(_rope_theta(config, path)),
        group_query_attention=kv_heads != heads, num_query_groups=kv_heads,
        untie_embeddings_and_output_weights=not config.get("tie_word_embeddings", False),
        hf_config={key: config[key] for key in KEPT if key in config})


# ---------------------------------------------------------------------------- directories

def read_hf_dir(path: str, config: Dict, make_vocab_size_divisible_by: int = 128
                ) -> ModelCheckpoint:
    """A `save_pretrained` Llama or Qwen3 directory whose config.json is `config` (its tokenizer,
    when it has one, is named in the args as the run's --tokenizer-model)."""
    args = args_from_hf_config(config, f"{path}/config.json", make_vocab_size_divisible_by,
                               directory_tokenizer(path))
    model = model_config_from_args(args, for_inference=True)
    weights = from_hf_state(read_hf_tensors(path), model)
    args.params_dtype = weights[layout.WORD_EMBEDDINGS].dtype
    return ModelCheckpoint(args=args, weights=weights)


def write_hf_dir(source: ModelCheckpoint, out_dir: str, tokenizer: ExportTokenizer,
                 dtype: Optional[torch.dtype] = None, max_shard_size: str = "2GB",
                 metrics_file: Optional[str] = None, model_path: Optional[str] = None
                 ) -> Dict[str, str]:
    """`source` as a LlamaForCausalLM (Qwen3ForCausalLM with --qk-layernorm) directory
    (app.checkpoint.hf.files.write_directory), the vocabulary trimmed to the tokenizer's size
    (args.vocab_size). Returns the files written."""
    args = source.args
    config = model_config_from_args(args, for_inference=True)
    blockers = llama_export_blockers(config)
    if blockers:
        raise HFConversionError("the model is not a Hugging Face Llama model: "
                                + "; ".join(blockers))
    architecture = ADAPTER.export_architecture(config)
    vocab_size = int(getattr(args, "vocab_size", None) or
                     source.weights[layout.WORD_EMBEDDINGS].shape[0])
    tensors = to_hf_state(source.weights, config, vocab_size)
    dtype = dtype or tensors["model.embed_tokens.weight"].dtype
    tensors = {k: v.to(dtype).contiguous().clone() for k, v in tensors.items()}
    return write_directory(out_dir, tensors,
                           hf_config(args, config, architecture, dtype, vocab_size, tokenizer),
                           args, source.iteration, tokenizer, max_shard_size, vocab_size,
                           metrics_file, model_path)



class LlamaAdapter(FamilyAdapter):
    """Hugging Face Llama, and Qwen3 (Llama's block with query/key norms: --qk-layernorm)."""

    family = "Llama"
    model_types = MODEL_TYPES
    export_order = 10

    def export_blockers(self, config: ModelConfig) -> List[str]:
        return llama_export_blockers(config)

    def export_architecture(self, config: ModelConfig) -> str:
        return QWEN3 if config.qk_layernorm else LLAMA

    read_directory = staticmethod(read_hf_dir)
    write_directory = staticmethod(write_hf_dir)


ADAPTER = LlamaAdapter()
