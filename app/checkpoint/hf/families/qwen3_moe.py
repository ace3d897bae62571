"""The Qwen3-MoE family's adapter: Hugging Face `Qwen3MoeForCausalLM` <-> our Llama block
(--swiglu, RMSNorm, no biases, RoPE) with --qk-layernorm and Mixture of Experts, no shared
expert; dense layers where --moe-layer-freq says (Hugging Face's mlp_only_layers, width
intermediate_size), the experts of width moe_intermediate_size (app.checkpoint.hf.moe holds what
the MoE families share).

config.json: `num_experts` (the Hub's Qwen3 configs' name) and `num_local_experts` (what
transformers 5.25 writes), `moe_intermediate_size` = --moe-ffn-hidden-size, `intermediate_size`
= --ffn-hidden-size, `num_experts_per_tok` = --moe-router-topk, `norm_topk_prob` = not
--moe-router-pre-softmax, `router_aux_loss_coef` = --moe-aux-loss-coeff, `decoder_sparse_step`
1 and `mlp_only_layers` the dense layers.
"""
from __future__ import annotations

import argparse
from typing import Dict

import torch

from app.checkpoint.hf.files import ExportTokenizer, HFConversionError
from app.checkpoint.hf.moe import (MoEFamilyAdapter, MoENames, llama_block_config,
                                   moe_config_fields, moe_layer_freq)
from app.config import ModelConfig

QWEN3_MOE = "Qwen3MoeForCausalLM"


class Qwen3MoeAdapter(MoEFamilyAdapter):
    """Hugging Face Qwen3-MoE."""

    family = "Qwen3-MoE"
    model_types = {"qwen3_moe": QWEN3_MOE}
    export_order = 20
    architecture = QWEN3_MOE
    names = MoENames(block="mlp", router="gate", gate="gate_proj", up="up_proj",
                     down="down_proj")
    qk_norm = True

    def config_json(self, args: argparse.Namespace, config: ModelConfig, dtype: torch.dtype,
                    vocab_size: int, tokenizer: ExportTokenizer) -> Dict:
        out = llama_block_config(args, config, dtype, vocab_size, tokenizer, QWEN3_MOE,
                                 "qwen3_moe", drop=("layer_types", "max_window_layers"))
        out.update(moe_config_fields(config, args), num_experts=config.moe.num_experts,
                   num_local_experts=config.moe.num_experts,
                   moe_intermediate_size=config.moe.moe_ffn_hidden_size)
        return out

    def import_fields(self, config: Dict, path: str) -> Dict:
        experts = config.get("num_experts") or config.get("num_local_experts")
        if not experts:
            raise HFConversionError(f"{path}: num_experts is not set: not a Mixture-of-Experts "
                                    "model")
        layers = int(config["num_hidden_layers"])
        return dict(num_experts=int(experts),
                    moe_ffn_hidden_size=int(config["moe_intermediate_size"]),
                    moe_router_topk=int(config.get("num_experts_per_tok", 8)),
                    moe_router_pre_softmax=not config.get("norm_topk_prob", False),
                    moe_aux_loss_coeff=float(config.get("router_aux_loss_coef", 0.0)),
                    moe_layer_freq=moe_layer_freq(config, path, layers))


ADAPTER = Qwen3MoeAdapter()
