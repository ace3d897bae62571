"""The Qwen2-MoE family's adapter: Hugging Face `Qwen2MoeForCausalLM` <-> our Llama block
(--swiglu, RMSNorm, RoPE, no query/key norms) with biases on q/k/v only (--disable-bias-linear
--add-qkv-bias) and Mixture of Experts with a shared expert gated by a sigmoid
(--moe-shared-expert-intermediate-size, --moe-shared-expert-gate); dense layers where
--moe-layer-freq says (mlp_only_layers). On disk each MoE layer's `mlp.shared_expert.{gate,up,
down}_proj` and `mlp.shared_expert_gate` are the shared expert (app.checkpoint.hf.moe holds what
the MoE families share).

config.json: `num_experts`, `moe_intermediate_size`, `shared_expert_intermediate_size`,
`intermediate_size` = --ffn-hidden-size, `num_experts_per_tok`, `norm_topk_prob` = not
--moe-router-pre-softmax, `router_aux_loss_coef`, `decoder_sparse_step` 1 and `mlp_only_layers`,
`qkv_bias` true (transformers 4 always builds the q/k/v biases).
"""
from __future__ import annotations

import argparse
from typing import Dict, List

import torch

from app.checkpoint.hf.files import ExportTokenizer, HFConversionError
from app.checkpoint.hf.moe import (MoEFamilyAdapter, MoENames, llama_block_config,
                                   moe_config_fields, moe_layer_freq)
from app.config import ModelConfig

QWEN2_MOE = "Qwen2MoeForCausalLM"


class Qwen2MoeAdapter(MoEFamilyAdapter):
    """Hugging Face Qwen2-MoE."""

    family = "Qwen2-MoE"
    model_types = {"qwen2_moe": QWEN2_MOE}
    export_order = 22
    architecture = QWEN2_MOE
    names = MoENames(block="mlp", router="gate", gate="gate_proj", up="up_proj",
                     down="down_proj", shared="shared_expert", shared_gate="shared_expert_gate")
    shared_expert = True

    def family_blockers(self, config: ModelConfig) -> List[str]:
        if not getattr(config, "add_qkv_bias", False) or config.add_bias_linear:
            return ["no --add-qkv-bias (with --disable-bias-linear): Qwen2-MoE's q/k/v "
                    "projections have biases and its other linear layers none"]
        return []

    def config_json(self, args: argparse.Namespace, config: ModelConfig, dtype: torch.dtype,
                    vocab_size: int, tokenizer: ExportTokenizer) -> Dict:
        out = llama_block_config(args, config, dtype, vocab_size, tokenizer, QWEN2_MOE,
                                 "qwen2_moe", drop=("attention_bias",))
        moe = config.moe
        out.update(moe_config_fields(config, args), num_experts=moe.num_experts,
                   moe_intermediate_size=moe.moe_ffn_hidden_size,
                   shared_expert_intermediate_size=moe.shared_expert_size, qkv_bias=True)
        return out

    def import_fields(self, config: Dict, path: str) -> Dict:
        if not config.get("qkv_bias", True):
            raise HFConversionError(f"{path}: qkv_bias false is not supported (Qwen2-MoE's "
                                    "q/k/v projections have biases: --add-qkv-bias)")
        if not config.get("shared_expert_intermediate_size"):
            raise HFConversionError(f"{path}: shared_expert_intermediate_size is not set: "
                                    "Qwen2-MoE's shared expert is required")
        layers = int(config["num_hidden_layers"])
        return dict(num_experts=int(config["num_experts"]),
                    moe_ffn_hidden_size=int(config["moe_intermediate_size"]),
                    moe_shared_expert_intermediate_size=int(
                        config["shared_expert_intermediate_size"]),
                    moe_shared_expert_gate=True, add_qkv_bias=True,
                    moe_router_topk=int(config.get("num_experts_per_tok", 4)),
                    moe_router_pre_softmax=not config.get("norm_topk_prob", False),
                    moe_aux_loss_coeff=float(config.get("router_aux_loss_coef", 0.0)),
                    moe_layer_freq=moe_layer_freq(config, path, layers))


ADAPTER = Qwen2MoeAdapter()
