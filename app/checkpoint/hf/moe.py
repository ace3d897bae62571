"""What the Hugging Face Mixture-of-Experts families (Qwen3-MoE, Mixtral, Qwen2-MoE: one adapter
each in app/checkpoint/hf/families/) share: the Llama block's attention and dense layers are the
Llama family's (app.checkpoint.hf.families.llama), the MoE layers are mapped by each family's
name table (`MoENames`), config.json's MoE fields follow one rule, and what no family expresses
is refused by name.

Per MoE layer i, on disk as the Hub holds them (transformers 5 fuses the experts in memory and
writes them back per expert; the fused names are read too):

    ours (language_model.transformer.layers.i.mlp.)   Hugging Face (model.layers.i.<block>.)
    router.weight [E, h]                               <router>.weight
    experts.dense_h_to_4h.weight [E, 2F, h]            experts.<e>.<gate> [F, h], <up> [F, h]
                                                       (fused: experts.gate_up_proj [E, 2F, h])
    experts.dense_4h_to_h.weight [E, h, F]             experts.<e>.<down> [h, F]
                                                       (fused: experts.down_proj [E, h, F])
    shared_experts.dense_h_to_4h.weight [2F_sh, h]     <shared>.gate_proj / up_proj [F_sh, h]
    shared_experts.dense_4h_to_h.weight [h, F_sh]      <shared>.down_proj [h, F_sh]
    shared_experts.gate_weight [1, h]                  <shared gate>.weight [1, h]

Routing: Megatron's default (top-k of the logits, softmax over the k) is Hugging Face's
`norm_topk_prob: true` (softmax over all, top-k, renormalised); --moe-router-pre-softmax (no
renormalisation) is `norm_topk_prob: false`. Which layers are MoE layers: Megatron counts from 0
(`i % N == 0`), Hugging Face from 1 (`(i + 1) % decoder_sparse_step == 0`), so an export writes
`decoder_sparse_step: 1` and the dense layers as `mlp_only_layers`, and an import turns both
into a --moe-layer-freq list (an int 1 when every layer is an MoE layer).
"""
from __future__ import annotations

import abc
import argparse
from dataclasses import dataclass
from typing import ClassVar, Dict, List, Optional, Tuple

import torch

from app.checkpoint import param_layout as layout
from app.checkpoint.hf.adapter import DecoderAdapter
from app.checkpoint.hf.families import llama
from app.checkpoint.hf.files import (ExportTokenizer, HFConversionError, directory_tokenizer,
                                     read_hf_tensors)
from app.checkpoint.model_args import model_config_from_args
from app.checkpoint.state import ModelCheckpoint
from app.config import ModelConfig


@dataclass(frozen=True)
class MoENames:
    """A family's names of an MoE layer's tensors under `model.layers.<i>.`."""

    block: str
    """The MoE block: "mlp" (Qwen) or "block_sparse_moe" (Mixtral)."""
    router: str
    gate: str
    up: str
    down: str
    shared: Optional[str] = None
    """The shared expert (Qwen2-MoE: "shared_expert"), None without one."""
    shared_gate: Optional[str] = None


FUSED_BLOCK = "mlp"
"""transformers 5's in-memory (save_original_format=False) names: the block is always `mlp`."""


def moe_blockers(config: ModelConfig) -> List[str]:
    """Reasons, one per option, why no Hugging Face MoE family computes what `config` routes:
    what their routers (softmax, top-k, optional renormalisation, no capacity) lack."""
    moe = config.moe
    if not moe.enabled:
        return ["no --num-experts: the model has no experts"]
    blockers = []
    if moe.moe_router_score_function != "softmax":
        blockers.append(f"--moe-router-score-function {moe.moe_router_score_function}: "
                        "Hugging Face's MoE routers take a softmax")
    if moe.moe_router_topk_scaling_factor:
        blockers.append("--moe-router-topk-scaling-factor: Hugging Face's routers do not scale "
                        "the routing probabilities")
    if moe.moe_router_enable_expert_bias:
        blockers.append("--moe-router-enable-expert-bias: Hugging Face's routers have no expert "
                        "bias")
    if moe.moe_expert_capacity_factor is not None:
        blockers.append("--moe-expert-capacity-factor: Hugging Face's experts drop no tokens")
    return blockers


def to_hf_moe(ours: Dict[str, torch.Tensor], config: ModelConfig, names: MoENames
              ) -> Dict[str, torch.Tensor]:
    """The MoE layers' tensors of our full tensors, under the family's names (per expert)."""
    out: Dict[str, torch.Tensor] = {}
    for i, is_moe in enumerate(config.moe.layer_pattern(config.num_layers)):
        if not is_moe:
            continue
        mine = lambda suffix: ours[layout.layer_param_name(i, f"mlp.{suffix}")]  # noqa: E731
        hf = f"model.layers.{i}.{names.block}."
        out[f"{hf}{names.router}.weight"] = mine("router.weight")
        gate, up = mine("experts.dense_h_to_4h.weight").chunk(2, dim=1)  # [E, F, h] each
        down = mine("experts.dense_4h_to_h.weight")
        for e in range(config.moe.num_experts):
            out.update({f"{hf}experts.{e}.{names.gate}.weight": gate[e],
                        f"{hf}experts.{e}.{names.up}.weight": up[e],
                        f"{hf}experts.{e}.{names.down}.weight": down[e]})
        if names.shared and config.moe.shared_expert_size:
            shared_gate, shared_up = mine("shared_experts.dense_h_to_4h.weight").chunk(2)
            out.update({f"{hf}{names.shared}.gate_proj.weight": shared_gate,
                        f"{hf}{names.shared}.up_proj.weight": shared_up,
                        f"{hf}{names.shared}.down_proj.weight":
                            mine("shared_experts.dense_4h_to_h.weight"),
                        f"{hf}{names.shared_gate}.weight": mine("shared_experts.gate_weight")})
    return out


def from_hf_moe(state: Dict[str, torch.Tensor], config: ModelConfig, names: MoENames
                ) -> Dict[str, torch.Tensor]:
    """Our MoE layers' tensors, taken out of `state` (per-expert names, or transformers 5's fused
    `mlp.experts.gate_up_proj` / `down_proj`); HFConversionError naming a missing key."""
    ours: Dict[str, torch.Tensor] = {}
    take = llama.take
    for i, is_moe in enumerate(config.moe.layer_pattern(config.num_layers)):
        if not is_moe:
            continue
        name = lambda suffix: layout.layer_param_name(i, f"mlp.{suffix}")  # noqa: E731
        hf = f"model.layers.{i}.{names.block}."
        fused = f"model.layers.{i}.{FUSED_BLOCK}."
        if f"{fused}experts.gate_up_proj" in state:
            ours[name("router.weight")] = take(state, f"{fused}{names.router}.weight")
            ours[name("experts.dense_h_to_4h.weight")] = take(state,
                                                              f"{fused}experts.gate_up_proj")
            ours[name("experts.dense_4h_to_h.weight")] = take(state, f"{fused}experts.down_proj")
            hf = fused
        else:
            ours[name("router.weight")] = take(state, f"{hf}{names.router}.weight")
            experts = range(config.moe.num_experts)
            per = {p: [take(state, f"{hf}experts.{e}.{getattr(names, p)}.weight")
                       for e in experts] for p in ("gate", "up", "down")}
            ours[name("experts.dense_h_to_4h.weight")] = torch.stack(
                [torch.cat([g, u]) for g, u in zip(per["gate"], per["up"])])
            ours[name("experts.dense_4h_to_h.weight")] = torch.stack(per["down"])
        if names.shared and config.moe.shared_expert_size:
            ours[name("shared_experts.dense_h_to_4h.weight")] = torch.cat(
                [take(state, f"{hf}{names.shared}.{p}_proj.weight") for p in ("gate", "up")])
            ours[name("shared_experts.dense_4h_to_h.weight")] = take(
                state, f"{hf}{names.shared}.down_proj.weight")
            ours[name("shared_experts.gate_weight")] = take(state,
                                                            f"{hf}{names.shared_gate}.weight")
    return ours


def moe_config_fields(config: ModelConfig) -> Dict:
    """config.json's MoE fields common to the families: the routed experts per token, the
    renormalisation, the auxiliary-loss coefficient (a name mapping: Hugging Face's loss pools
    the layers), and which layers are MoE layers (decoder_sparse_step 1 + mlp_only_layers)."""
    moe = config.moe
    return {"num_experts_per_tok": moe.moe_router_topk,
            "norm_topk_prob": not moe.moe_router_pre_softmax,
            "router_aux_loss_coef": moe.aux_loss_coeff("aux_loss"),
            "output_router_logits": False, "decoder_sparse_step": 1,
            "mlp_only_layers": [i for i, is_moe in enumerate(moe.layer_pattern(config.num_layers))
                                if not is_moe]}


def moe_layer_freq(config: Dict, path: str, layers: int):
    """Megatron's --moe-layer-freq of a config.json's decoder_sparse_step and mlp_only_layers
    (Hugging Face's layer i is an MoE layer when it is not listed and (i + 1) % step == 0): 1
    when every layer is, else the list."""
    step = int(config.get("decoder_sparse_step", 1) or 1)
    dense = set(config.get("mlp_only_layers") or [])
    if any(not 0 <= i < layers for i in dense):
        raise HFConversionError(f"{path}: mlp_only_layers {sorted(dense)} names layers outside "
                                f"[0, {layers})")
    pattern = [int(i not in dense and (i + 1) % step == 0) for i in range(layers)]
    if not any(pattern):
        raise HFConversionError(f"{path}: no layer is an MoE layer (decoder_sparse_step {step}, "
                                f"mlp_only_layers {sorted(dense)}): a dense model")
    return 1 if all(pattern) else pattern


class MoEFamilyAdapter(DecoderAdapter):
    """A Hugging Face MoE family on the Llama block: its subclass gives the names, the
    architecture, what it requires of the model and its config.json fields."""

    names: ClassVar[MoENames]
    architecture: ClassVar[str]
    qk_norm: ClassVar[bool] = False
    """The family's attention has query/key norms (--qk-layernorm required, else refused)."""
    shared_expert: ClassVar[bool] = False
    """The family has a gated shared expert (required), else none (refused)."""
    all_layers_moe: ClassVar[bool] = False
    """The family has no dense layers."""
    renormalises: ClassVar[bool] = False
    """The family always renormalises the top-k (no norm_topk_prob): --moe-router-pre-softmax
    is refused."""

    def family_blockers(self, config: ModelConfig) -> List[str]:
        """What of `config` the family's block itself does not express (beyond moe_blockers and
        the Llama block's)."""
        return []

    def export_blockers(self, config: ModelConfig) -> List[str]:
        if not config.moe.enabled:
            return ["no --num-experts: the model has no experts"]
        blockers = [b for b in llama.llama_export_blockers(config) if "--num-experts" not in b]
        blockers += moe_blockers(config) + self.family_blockers(config)
        if config.qk_layernorm != self.qk_norm:
            blockers.append(f"--qk-layernorm: {self.family} has query/key norms"
                            if self.qk_norm else f"--qk-layernorm: {self.family} has no "
                            "query/key norms")
        has_shared = bool(config.moe.shared_expert_size)
        if has_shared != self.shared_expert:
            blockers.append(f"--moe-shared-expert-intermediate-size: {self.family} has "
                            + ("a shared expert" if self.shared_expert else "no shared expert"))
        elif has_shared and not config.moe.moe_shared_expert_gate:
            blockers.append(f"no --moe-shared-expert-gate: {self.family}'s shared expert is "
                            "gated (sigmoid)")
        if self.all_layers_moe and not all(config.moe.layer_pattern(config.num_layers)):
            blockers.append(f"--moe-layer-freq {config.moe.moe_layer_freq}: every "
                            f"{self.family} layer is an MoE layer")
        if self.renormalises and config.moe.moe_router_pre_softmax:
            blockers.append(f"--moe-router-pre-softmax: {self.family} renormalises the top-k "
                            "probabilities")
        return blockers

    def export_architecture(self, config: ModelConfig) -> str:
        return self.architecture

    @abc.abstractmethod
    def config_json(self, args: argparse.Namespace, config: ModelConfig, dtype: torch.dtype,
                    vocab_size: int, tokenizer: ExportTokenizer) -> Dict:
        """The family's config.json for the model `config`."""

    @abc.abstractmethod
    def import_fields(self, config: Dict, path: str) -> Dict:
        """Our args (Megatron's names) the family's config.json sets beyond the Llama block's:
        the experts, their width, the routing, which layers are MoE layers."""

    def read_directory(self, path: str, config: Dict,
                       make_vocab_size_divisible_by: int = 128) -> ModelCheckpoint:
        args = llama.args_from_hf_config(config, f"{path}/config.json",
                                         make_vocab_size_divisible_by, directory_tokenizer(path))
        fields = self.import_fields(config, f"{path}/config.json")
        vars(args).update(qk_layernorm=self.qk_norm, moe_router_load_balancing_type="aux_loss",
                          **fields)
        model = model_config_from_args(args, for_inference=True)
        state = dict(read_hf_tensors(path))
        weights = from_hf_moe(state, model, self.names)
        weights.update(llama.from_hf_state(state, model))
        args.params_dtype = weights[layout.WORD_EMBEDDINGS].dtype
        return ModelCheckpoint(args=args, weights=weights)

    def hf_tensors(self, weights: Dict[str, torch.Tensor], config: ModelConfig,
                   vocab_size: int) -> Dict[str, torch.Tensor]:
        tensors = llama.to_hf_state(weights, config, vocab_size)
        tensors.update(to_hf_moe(weights, config, self.names))
        return tensors

    def hf_config_json(self, args: argparse.Namespace, config: ModelConfig, dtype: torch.dtype,
                       vocab_size: int, tokenizer: ExportTokenizer) -> Dict:
        return self.config_json(args, config, dtype, vocab_size, tokenizer)


def llama_block_config(args: argparse.Namespace, config: ModelConfig, dtype: torch.dtype,
                       vocab_size: int, tokenizer: ExportTokenizer, architecture: str,
                       model_type: str, drop: Tuple[str, ...] = ()) -> Dict:
    """The Llama block's config.json fields (app.checkpoint.hf.families.llama.hf_config, as
    Qwen3 writes them, without `drop`), named as `architecture` of `model_type`."""
    out = llama.hf_config(args, config, llama.QWEN3, dtype, vocab_size, tokenizer)
    for key in drop:
        out.pop(key, None)
    out.update(architectures=[architecture], model_type=model_type)
    return out
