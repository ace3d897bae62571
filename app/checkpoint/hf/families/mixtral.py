"""The Mixtral family's adapter: Hugging Face `MixtralForCausalLM` <-> our Llama block (--swiglu,
RMSNorm, no biases, RoPE, no query/key norms) with Mixture of Experts in every layer, no shared
expert, the top-k always renormalised (no --moe-router-pre-softmax): Megatron-LM's Mixtral
recipe (examples/mixtral). On disk each layer's `block_sparse_moe.gate` is the router and
`experts.<e>.w1 / w3 / w2` the gate / up / down projections (app.checkpoint.hf.moe holds what
the MoE families share).

config.json: `num_local_experts`, `intermediate_size` = the experts' width (--moe-ffn-hidden-size;
an import sets --ffn-hidden-size to it as well, as Megatron's Mixtral script does),
`num_experts_per_tok` = --moe-router-topk, `router_aux_loss_coef` = --moe-aux-loss-coeff;
`router_jitter_noise` must be 0 (Megatron's --moe-input-jitter-eps is not supported).
"""
from __future__ import annotations

import argparse
from typing import Dict

import torch

from app.checkpoint.hf.files import ExportTokenizer, HFConversionError
from app.checkpoint.hf.moe import MoEFamilyAdapter, MoENames, llama_block_config
from app.config import ModelConfig

MIXTRAL = "MixtralForCausalLM"


class MixtralAdapter(MoEFamilyAdapter):
    """Hugging Face Mixtral."""

    family = "Mixtral"
    model_types = {"mixtral": MIXTRAL}
    export_order = 21
    architecture = MIXTRAL
    names = MoENames(block="block_sparse_moe", router="gate", gate="w1", up="w3", down="w2")
    all_layers_moe = True
    renormalises = True

    def config_json(self, args: argparse.Namespace, config: ModelConfig, dtype: torch.dtype,
                    vocab_size: int, tokenizer: ExportTokenizer) -> Dict:
        out = llama_block_config(args, config, dtype, vocab_size, tokenizer, MIXTRAL, "mixtral",
                                 drop=("layer_types", "use_sliding_window", "max_window_layers",
                                       "attention_bias"))
        moe = config.moe
        out.update(intermediate_size=moe.moe_ffn_hidden_size, num_local_experts=moe.num_experts,
                   num_experts_per_tok=moe.moe_router_topk,
                   router_aux_loss_coef=moe.aux_loss_coeff("aux_loss"),
                   output_router_logits=False, router_jitter_noise=0.0)
        return out

    def import_fields(self, config: Dict, path: str) -> Dict:
        if float(config.get("router_jitter_noise", 0.0) or 0.0):
            raise HFConversionError(f"{path}: router_jitter_noise "
                                    f"{config['router_jitter_noise']} is not supported "
                                    "(Megatron's --moe-input-jitter-eps: not supported yet)")
        width = int(config["intermediate_size"])
        return dict(num_experts=int(config.get("num_local_experts", 8)),
                    moe_ffn_hidden_size=width, ffn_hidden_size=width,
                    moe_router_topk=int(config.get("num_experts_per_tok", 2)),
                    moe_router_pre_softmax=False,
                    moe_aux_loss_coeff=float(config.get("router_aux_loss_coef", 0.0)),
                    moe_layer_freq=1)


ADAPTER = MixtralAdapter()
