"""The Nemotron family's adapter: Hugging Face Nemotron (`NemotronForCausalLM`) <-> our model
with Megatron's Nemotron options (--normalization LayerNorm --apply-layernorm-1p
--squared-relu, partial RoPE --rotary-percent, GQA, no gated MLP), weight names and layouts,
config.json, and what of our model Nemotron cannot express.

Layout differences handled both ways (our full tensors are what one process holds):
- our fused QKV rows are [groups, (queries of the group, key, value), head_dim]; HF keeps
  q_proj [heads, hd], k_proj and v_proj [groups, hd] apart (the Llama family's split);
- HF's LayerNorm1P scales by 1 + weight, as --apply-layernorm-1p does: the weights travel as
  they are (a model without --apply-layernorm-1p is written with weight - 1) and an import
  sets --apply-layernorm-1p;
- the MLP is up_proj (our dense_h_to_4h), relu^2, down_proj (dense_4h_to_h);
- HF's `partial_rotary_factor` is --rotary-percent: both rotate the first int(head_dim x
  factor) channels of each head, non-interleaved;
- HF's vocabulary is the tokenizer's; ours is padded (trimmed on export, padded on import).
"""
from __future__ import annotations

import argparse
from typing import Dict, List, Optional

import torch

from app.checkpoint import param_layout as layout
from app.checkpoint.hf.adapter import DecoderAdapter, shift_norm_weights
from app.checkpoint.hf.families.llama import (TOKEN_IDS, fuse_qkv, linear_tensors,
                                               rope_settings, split_qkv, take, take_outer)
from app.checkpoint.hf.files import (ExportTokenizer, HFConversionError, decoder_import_args,
                                     directory_tokenizer, read_hf_tensors)
from app.checkpoint.model_args import model_config_from_args
from app.checkpoint.state import ModelCheckpoint
from app.config import ModelConfig

NEMOTRON = "NemotronForCausalLM"
MODEL_TYPES = {"nemotron": NEMOTRON}
_LAYER = {  # our suffix after layers.{i}. -> HF's after model.layers.{i}.
    "input_layernorm": "input_layernorm", "post_attention_layernorm": "post_attention_layernorm",
    "attention.dense": "self_attn.o_proj", "mlp.dense_h_to_4h": "mlp.up_proj",
    "mlp.dense_4h_to_h": "mlp.down_proj"}


def nemotron_export_blockers(config: ModelConfig) -> List[str]:
    """Reasons, one per option, why `config` cannot be written as a Hugging Face Nemotron model;
    empty when it can. Each names the command-line option that set it (or that is missing)."""
    blockers = []
    if not config.squared_relu:
        blockers.append("no --squared-relu: Nemotron's MLP is relu(x)^2")
    if config.normalization != "LayerNorm":
        blockers.append(f"--normalization {config.normalization}: Nemotron's norms are "
                        "LayerNorm (1 + weight, with a bias)")
    if config.position_embedding_type != "rope":
        blockers.append(f"--position-embedding-type {config.position_embedding_type}: Nemotron "
                        "has rotary positions only (rope)")
    elif config.use_rope_scaling or config.rotary_seq_len_interpolation_factor not in (None, 1):
        blockers.append("--use-rope-scaling / --rotary-seq-len-interpolation-factor: "
                        "Nemotron's RoPE is unscaled")
    if config.qk_layernorm:
        blockers.append("--qk-layernorm: Nemotron has no query/key norms")
    if config.qkv_bias != config.add_bias_linear:
        blockers.append("--add-qkv-bias with --disable-bias-linear: Nemotron's attention_bias "
                        "biases the output projection too")
    return blockers


def to_hf_state(ours: Dict[str, torch.Tensor], config: ModelConfig,
                vocab_size: Optional[int] = None) -> Dict[str, torch.Tensor]:
    """Our full tensors (our names) -> HF Nemotron names and layouts (zero-centred norm
    weights); `vocab_size` trims the vocabulary rows (None keeps them all)."""
    ours = shift_norm_weights(ours, 0.0 if config.layernorm_zero_centered_gamma else -1.0)
    rows = slice(None, vocab_size)
    out = {"model.embed_tokens.weight": ours[layout.WORD_EMBEDDINGS][rows],
           "model.norm.weight": ours[layout.FINAL_NORM[0]],
           "model.norm.bias": ours[layout.FINAL_NORM[1]]}
    if config.untie_embeddings_and_output_weights:
        out["lm_head.weight"] = ours[layout.OUTPUT_LAYER][rows]
    for i in range(config.num_layers):
        mine = lambda suffix: ours[layout.layer_param_name(i, suffix)]  # noqa: E731
        hf = f"model.layers.{i}."
        for kind in linear_tensors(config.add_bias_linear):
            q, k, v = split_qkv(mine(f"attention.query_key_value.{kind}"), config)
            out.update({f"{hf}self_attn.{p}_proj.{kind}": t for p, t in zip("qkv", (q, k, v))})
        for suffix, theirs in _LAYER.items():
            bias = "layernorm" in suffix or config.add_bias_linear
            for kind in linear_tensors(bias):
                out[f"{hf}{theirs}.{kind}"] = mine(f"{suffix}.{kind}")
    return out


def from_hf_state(hf: Dict[str, torch.Tensor], config: ModelConfig) -> Dict[str, torch.Tensor]:
    """HF Nemotron tensors -> our names and layouts; inverse of to_hf_state for a model with
    --apply-layernorm-1p (the vocabulary keeps HF's rows). A missing or unknown key raises
    HFConversionError naming it."""
    state = dict(hf)
    ours = take_outer(state, config, norm_bias=True)
    for i in range(config.num_layers):
        name = lambda suffix: layout.layer_param_name(i, suffix)  # noqa: E731
        hf_name = f"model.layers.{i}."
        for kind in linear_tensors(config.add_bias_linear):
            q, k, v = (take(state, f"{hf_name}self_attn.{p}_proj.{kind}") for p in "qkv")
            ours[name(f"attention.query_key_value.{kind}")] = fuse_qkv(q, k, v, config)
        for suffix, theirs in _LAYER.items():
            for kind in linear_tensors("layernorm" in suffix or config.add_bias_linear):
                ours[name(f"{suffix}.{kind}")] = take(state, f"{hf_name}{theirs}.{kind}")
    if state:
        raise HFConversionError(f"Hugging Face key {sorted(state)[0]!r} cannot be mapped to a "
                                f"Nemotron model with {config.num_layers} layers (config.json "
                                "num_hidden_layers, attention_bias, mlp_bias)")
    return ours


def hf_config(args: argparse.Namespace, config: ModelConfig, dtype: torch.dtype,
              vocab_size: int, tokenizer: ExportTokenizer) -> Dict:
    """config.json of NemotronForCausalLM for the model `config` (its Megatron `args` give the
    rest); the special ids are the ones an import kept in `args`, else the tokenizer's."""
    theta = float(config.rotary_base)
    kept = getattr(args, "hf_config", None) or {}
    ids = {"bos_token_id": tokenizer.bos, "eos_token_id": tokenizer.eos,
           "pad_token_id": tokenizer.pad}
    return {
        "architectures": [NEMOTRON], "model_type": "nemotron", "vocab_size": vocab_size,
        "hidden_size": config.hidden_size, "intermediate_size": config.ffn_hidden_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_kv_heads, "head_dim": config.head_dim,
        "hidden_act": "relu2", "max_position_embeddings": config.max_position_embeddings,
        "initializer_range": float(getattr(args, "init_method_std", 0.02)),
        "norm_eps": config.layernorm_epsilon, "use_cache": True,
        "tie_word_embeddings": not config.untie_embeddings_and_output_weights,
        "rope_theta": theta, "partial_rotary_factor": float(config.rotary_percent),
        "rope_parameters": {"rope_type": "default", "rope_theta": theta,
                            "partial_rotary_factor": float(config.rotary_percent)},
        "attention_bias": config.add_bias_linear, "mlp_bias": config.add_bias_linear,
        "attention_dropout": float(getattr(args, "attention_dropout", 0.0)),
        "dtype": str(dtype).replace("torch.", ""),
        **{key: kept.get(key, default) for key, default in ids.items()}}


def args_from_hf_config(config: Dict, path: str, make_vocab_size_divisible_by: int = 128,
                        tokenizer_model: Optional[str] = None) -> argparse.Namespace:
    """Megatron args of a Nemotron config.json (`tokenizer_model`: the directory holding its
    tokenizer, None when it has none)."""
    if config.get("hidden_act", "relu2") != "relu2":
        raise HFConversionError(f"{path}: hidden_act {config['hidden_act']!r} is not supported "
                                "(Megatron's --squared-relu: relu2)")
    biases = (bool(config.get("attention_bias", False)), bool(config.get("mlp_bias", False)))
    if biases[0] != biases[1]:
        raise HFConversionError(f"{path}: attention_bias {biases[0]} with mlp_bias {biases[1]} "
                                "is not supported: --disable-bias-linear drops the biases of "
                                "both or neither")
    rope = rope_settings(config, path)
    if rope["use_rope_scaling"]:
        raise HFConversionError(f"{path}: rope_type llama3 is not supported (Nemotron's RoPE is "
                                "the default one)")
    params = config.get("rope_parameters") or {}
    factor = float(params.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0)))
    return decoder_import_args(
        config, 4096, make_vocab_size_divisible_by, tokenizer_model,
        layernorm_epsilon=float(config.get("norm_eps", 1e-5)), normalization="LayerNorm",
        layernorm_zero_centered_gamma=True, squared_relu=True, add_bias_linear=biases[0],
        add_qkv_bias=biases[0], rotary_percent=factor, rotary_base=rope["rotary_base"],
        hf_config={key: config[key] for key in TOKEN_IDS if key in config})


class NemotronAdapter(DecoderAdapter):
    """Hugging Face Nemotron (Nemotron-Mini's block: LayerNorm-1p, squared ReLU, partial RoPE)."""

    family = "Nemotron"
    model_types = MODEL_TYPES
    export_order = 20

    def export_blockers(self, config: ModelConfig) -> List[str]:
        return nemotron_export_blockers(config)

    def export_architecture(self, config: ModelConfig) -> str:
        return NEMOTRON

    def read_directory(self, path: str, config: Dict,
                       make_vocab_size_divisible_by: int = 128) -> ModelCheckpoint:
        args = args_from_hf_config(config, f"{path}/config.json", make_vocab_size_divisible_by,
                                   directory_tokenizer(path))
        model = model_config_from_args(args, for_inference=True)
        weights = from_hf_state(read_hf_tensors(path), model)
        args.params_dtype = weights[layout.WORD_EMBEDDINGS].dtype
        return ModelCheckpoint(args=args, weights=weights)

    def hf_tensors(self, weights: Dict[str, torch.Tensor], config: ModelConfig,
                   vocab_size: int) -> Dict[str, torch.Tensor]:
        return to_hf_state(weights, config, vocab_size)

    def hf_config_json(self, args: argparse.Namespace, config: ModelConfig, dtype: torch.dtype,
                       vocab_size: int, tokenizer: ExportTokenizer) -> Dict:
        return hf_config(args, config, dtype, vocab_size, tokenizer)


ADAPTER = NemotronAdapter()
