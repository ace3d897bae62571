"""Our parameter names <-> Megatron Core's GPT keys in a `torch_dist` checkpoint: the one table.

Megatron Core (checked against core_v0.19.0: GPTModel / TransformerBlock / TransformerLayer
`sharded_state_dict`, the local spec of gpt_layer_specs.py) names the GPT tensors by module path
without the layer number: every transformer layer's tensor is one global tensor
`decoder.layers.<module>.<param>` stacked along a leading layer dimension of size num_layers
(`non_homogeneous_layers` False, `singleton_local_shards` False). Its local spec keeps the two
LayerNorms as separate modules but maps their keys to Transformer Engine's fused names
(`input_layernorm.` -> `self_attention.linear_qkv.layer_norm_`, `pre_mlp_layernorm.` ->
`mlp.linear_fc1.layer_norm_`), so checkpoints of both specs have the same keys, which are the
ones below. Our names are Megatron-LM's legacy ones with global layer indices
(docs/architecture.md). The fused QKV rows are ordered alike in both: per query group, its query
heads then its key and value head (Megatron Core's `[ng, (np/ng + 2) * hn]`, our
checkpoint_version 3.0), so no row is permuted. The Llama block's keys are the same table: with
--normalization RMSNorm the norms keep only `layer_norm_weight` (Megatron Core's local spec puts
torch's RMSNorm there, under the same fused names), --qk-layernorm adds the per-head norms
`self_attention.{q,k}_layernorm.*` (not renamed by the local spec), --disable-bias-linear drops
the biases, and with --swiglu `mlp.linear_fc1.weight` is [gate; up] of 2 x ffn rows, where TP rank
r holds [gate_r; up_r] (Megatron Core's `apply_swiglu_sharded_factory`; app.checkpoint.sharding).

Mixture of Experts (checked against Megatron Core 0.16.1's local-spec MoE GPTModel, whose
SequentialMLP stores its local experts as one global tensor with an expert axis): an MoE layer's
`mlp.router.weight` [E, h] (and `mlp.router.expert_bias` [E]), the experts as
`mlp.experts.experts.linear_fc1.weight` [E, 2F, h] (each expert [gate; up]) and
`mlp.experts.experts.linear_fc2.weight` [E, h, F] (the doubled `experts.experts` is 0.16.1's),
the shared expert as `mlp.shared_experts.linear_fc{1,2}.weight` and its `gate_weight` [1, h]; the
layer's pre-MLP norm keeps the dense name. A model whose layers are not all alike
(--moe-layer-freq a list, or an int > 1: Megatron's `non_homogeneous_layers`) stores every
layer under its own key `decoder.layers.<i>.<module>.<param>` without the layer dimension
(`to_mcore(name, stacked=False)`).

Optimizer states follow the model keys (megatron/core/dist_checkpointing/optimizer.py and the
distributed optimizer's `fully_reshardable` format): `optimizer.state.<state>.<model key>` with
<state> `exp_avg`, `exp_avg_sq`, `momentum_buffer`, and the fp32 main weights as `fp32_param`
(Float16Optimizer) or `param` (DistributedOptimizer).

Which dimension tensor parallelism splits is not here: it is the parameter's own mark
(`param.partition_dim`, set by the app.mpu layers; app.checkpoint.param_layout for offline tensors).
"""
from __future__ import annotations

import re
from typing import Any, Dict, Optional, Tuple

import torch

from app.checkpoint import CheckpointError
from app.config.param_names import (FINAL_NORM, LAYER_PREFIX, OUTPUT_LAYER, POSITION_EMBEDDINGS,
                                    TIED_HEAD, WORD_EMBEDDINGS)

OUR_LAYER_PREFIX = LAYER_PREFIX + "."
MCORE_LAYER_PREFIX = "decoder.layers."

LAYER_KEYS: Dict[str, str] = {
    # our suffix after layers.{i}.         Megatron Core suffix after decoder.layers.
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "input_layernorm.bias": "self_attention.linear_qkv.layer_norm_bias",
    "attention.query_key_value.weight": "self_attention.linear_qkv.weight",
    "attention.query_key_value.bias": "self_attention.linear_qkv.bias",
    "attention.q_layernorm.weight": "self_attention.q_layernorm.weight",  # --qk-layernorm
    "attention.q_layernorm.bias": "self_attention.q_layernorm.bias",
    "attention.k_layernorm.weight": "self_attention.k_layernorm.weight",
    "attention.k_layernorm.bias": "self_attention.k_layernorm.bias",
    "attention.dense.weight": "self_attention.linear_proj.weight",
    "attention.dense.bias": "self_attention.linear_proj.bias",
    "post_attention_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
    "post_attention_layernorm.bias": "mlp.linear_fc1.layer_norm_bias",
    "mlp.dense_h_to_4h.weight": "mlp.linear_fc1.weight",
    "mlp.dense_h_to_4h.bias": "mlp.linear_fc1.bias",
    "mlp.dense_4h_to_h.weight": "mlp.linear_fc2.weight",
    "mlp.dense_4h_to_h.bias": "mlp.linear_fc2.bias",
    # an MoE layer (--num-experts): router, experts (an expert axis after the layer axis), shared
    "mlp.router.weight": "mlp.router.weight",
    "mlp.router.expert_bias": "mlp.router.expert_bias",
    "mlp.experts.dense_h_to_4h.weight": "mlp.experts.experts.linear_fc1.weight",
    "mlp.experts.dense_4h_to_h.weight": "mlp.experts.experts.linear_fc2.weight",
    "mlp.shared_experts.dense_h_to_4h.weight": "mlp.shared_experts.linear_fc1.weight",
    "mlp.shared_experts.dense_4h_to_h.weight": "mlp.shared_experts.linear_fc2.weight",
    "mlp.shared_experts.gate_weight": "mlp.shared_experts.gate_weight",
}
"""One transformer layer: our suffix -> Megatron Core's key suffix (stacked over layers)."""

MODEL_KEYS: Dict[str, str] = {
    WORD_EMBEDDINGS: "embedding.word_embeddings.weight",
    POSITION_EMBEDDINGS: "embedding.position_embeddings.weight",
    FINAL_NORM[0]: "decoder.final_layernorm.weight",
    FINAL_NORM[1]: "decoder.final_layernorm.bias",
    OUTPUT_LAYER: "output_layer.weight",
    TIED_HEAD: "embedding.word_embeddings.weight",
}
"""The tensors outside the layers. `word_embeddings.weight` is the last pipeline stage's tied
copy of the word embeddings: Megatron Core stores it under the first stage's key as a replica
(replica_id (1, 0, dp)), so it is read from there and never written."""

TIED_COPY = TIED_HEAD

EXTRA_STATE_OF: Dict[str, str] = {
    "attention.query_key_value.weight": "self_attention.linear_qkv",
    "attention.dense.weight": "self_attention.linear_proj",
    "mlp.dense_h_to_4h.weight": "mlp.linear_fc1", "mlp.dense_4h_to_h.weight": "mlp.linear_fc2",
    "mlp.shared_experts.dense_h_to_4h.weight": "mlp.shared_experts.linear_fc1",
    "mlp.shared_experts.dense_4h_to_h.weight": "mlp.shared_experts.linear_fc2",
    "mlp.experts.dense_h_to_4h.weight": "mlp.experts.experts.linear_fc1",
    "mlp.experts.dense_4h_to_h.weight": "mlp.experts.experts.linear_fc2"}
"""Our layer weight -> the linear layer holding it, whose `_extra_state` (None outside
Transformer Engine's FP8) Megatron Core stores as a ShardedObject
`decoder.layers.<module>._extra_state` per layer (and, for the routed experts, per expert); a
Megatron model asks for them on load, so we write them (empty) and ignore them on read."""
EXTRA_STATE_MODULES = tuple(EXTRA_STATE_OF.values())[:4]
"""The dense layer's four linear layers with an `_extra_state`."""
EXPERT_MODULES = frozenset(v for k, v in EXTRA_STATE_OF.items() if k.startswith("mlp.experts."))
"""The routed experts' linear layers: one `_extra_state` per (layer, expert)."""

OPTIMIZER_PREFIX = "optimizer.state."
MAIN_WEIGHT_KEYS = ("fp32_param", "param")
"""The fp32 main weights: Float16Optimizer's name, then DistributedOptimizer's."""

_OUR_LAYER = re.compile(rf"^{re.escape(OUR_LAYER_PREFIX)}(\d+)\.(.+)$")
_FROM_MCORE = {mcore: ours for ours, mcore in LAYER_KEYS.items()}
_MODEL_FROM_MCORE = {mcore: ours for ours, mcore in MODEL_KEYS.items() if ours != TIED_COPY}
_PER_LAYER_KEY = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


def stacks_layers(moe_layer_freq: object, num_experts: Optional[int]) -> bool:
    """Whether Megatron Core stacks a model's layers along a leading dimension (its
    TransformerBlock: not when `non_homogeneous_layers`, which an MoE model's --moe-layer-freq
    sets when it is a list or an int > 1)."""
    if num_experts is None:
        return True
    return isinstance(moe_layer_freq, int) and moe_layer_freq == 1


def to_mcore(name: str, stacked: bool = True) -> Tuple[str, Optional[int]]:
    """(Megatron Core key, global layer index or None) of our parameter `name`; with `stacked`
    False a layer's key names its layer (`decoder.layers.<i>.`, no layer dimension). KeyError
    naming it for a parameter the table does not know."""
    match = _OUR_LAYER.match(name)
    if match:
        suffix = match.group(2)
        if suffix not in LAYER_KEYS:
            raise KeyError(f"parameter {name!r} has no Megatron Core key (known layer "
                           f"parameters: {', '.join(LAYER_KEYS)})")
        layer = int(match.group(1))
        prefix = MCORE_LAYER_PREFIX if stacked else f"{MCORE_LAYER_PREFIX}{layer}."
        return prefix + LAYER_KEYS[suffix], layer
    if name not in MODEL_KEYS:
        raise KeyError(f"parameter {name!r} has no Megatron Core key (app/checkpoint/"
                       "app/checkpoint/mcore/names.py lists every GPT-2 parameter)")
    return MODEL_KEYS[name], None


def is_stacked(key: str) -> bool:
    """Whether the Megatron Core tensor `key` stacks the layers along a leading dimension (a
    layer key without its layer's index)."""
    return key.startswith(MCORE_LAYER_PREFIX) and not _PER_LAYER_KEY.match(key)


def layer_of_key(key: str) -> Optional[int]:
    """The layer index a per-layer key `decoder.layers.<i>.` names; None for any other key."""
    match = _PER_LAYER_KEY.match(key)
    return int(match.group(1)) if match else None


def from_mcore(key: str, layer: Optional[int] = None) -> str:
    """Our parameter name of Megatron Core `key` (of `layer` when the key is stacked; a
    per-layer key names its own); KeyError for a key the table does not know."""
    match = _PER_LAYER_KEY.match(key)
    if match:
        key, layer = MCORE_LAYER_PREFIX + match.group(2), int(match.group(1))
    if key.startswith(MCORE_LAYER_PREFIX):
        suffix = key[len(MCORE_LAYER_PREFIX):]
        if suffix not in _FROM_MCORE or layer is None:
            raise KeyError(f"Megatron Core key {key!r} is not a GPT-2 layer tensor we know")
        return f"{OUR_LAYER_PREFIX}{layer}.{_FROM_MCORE[suffix]}"
    if key not in _MODEL_FROM_MCORE:
        raise KeyError(f"Megatron Core key {key!r} is not a GPT-2 tensor we know")
    return _MODEL_FROM_MCORE[key]


def optimizer_key(state: str, key: str) -> str:
    """`optimizer.state.<state>.<model key>`: one optimizer state tensor of a model tensor."""
    return f"{OPTIMIZER_PREFIX}{state}.{key}"


def split_optimizer_key(key: str) -> Optional[Tuple[str, str]]:
    """(state, model key) of an `optimizer.state.<state>.<model key>` key; None otherwise."""
    if not key.startswith(OPTIMIZER_PREFIX):
        return None
    state, _, model_key = key[len(OPTIMIZER_PREFIX):].partition(".")
    return (state, model_key) if model_key else None


def extra_state_key(module: str, layer: int, num_layers: int, stacked: bool = True,
                    expert: Optional[Tuple[int, int]] = None) -> str:
    """The DCP key of one layer's `_extra_state` object: Megatron Core's ShardedObject unique
    key `<key>/shard_<offset>_<shape>` with the layer as offset and num_layers as shape (per-layer
    keys: the layer in the key, offset 0 of 1); a routed expert's, `expert` = (global expert,
    experts), adds the expert axis (`shard_<layer>.<g>_<L>.<E>`, per-layer `shard_<g>_<E>`)."""
    offset, shape = ((layer,), (num_layers,)) if stacked else ((), ())
    if expert is not None:
        offset, shape = offset + expert[:1], shape + expert[1:]
    prefix = MCORE_LAYER_PREFIX if stacked else f"{MCORE_LAYER_PREFIX}{layer}."
    return object_key(f"{prefix}{module}._extra_state", offset or (0,), shape or (1,))


def object_key(key: str, offset: Tuple[int, ...], shape: Tuple[int, ...]) -> str:
    """Megatron Core's DCP key of a ShardedObject: `<key>/shard_<o.o>_<s.s>`."""
    return f"{key}/shard_{'.'.join(map(str, offset))}_{'.'.join(map(str, shape))}"


_MCORE_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_MCORE_LOCAL_NORMS = {"input_layernorm.": "self_attention.linear_qkv.layer_norm_",
                      "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}
"""Megatron Core's local-spec LayerNorm names -> the fused names of the table above."""
_LOCAL_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12]\.weight)$")


def is_mcore_model(model: Dict[str, Any]) -> bool:
    """Whether a checkpoint's `model` entry is Megatron Core's flat GPTModel state dict
    (Megatron-LM's `--ckpt-format torch` save of a Megatron Core model) rather than the
    legacy nested `language_model` dict."""
    return "language_model" not in model and any(
        k.startswith(("embedding.", "decoder.")) for k in model)


def from_mcore_model(model: Dict[str, Any], layer_offset: int = 0) -> Dict[str, Any]:
    """Megatron Core's flat GPTModel state dict (`state_dict_for_save_checkpoint`) -> our flat
    state dict. Its layer numbers are the stage's own; `layer_offset` (the stage's first global
    layer) makes them global. An MoE layer's local experts (`mlp.experts.local_experts.<j>.
    linear_fc{1,2}.weight`, this expert-parallel rank's j-th) are stacked in j order into our
    [E/EP, ...] expert weights. `_extra_state` entries (Transformer Engine's FP8 metadata, None
    here) are dropped; a key this table does not know raises CheckpointError naming it."""
    flat: Dict[str, Any] = {}
    experts: Dict[str, Dict[int, Any]] = {}
    for key, value in model.items():
        if key.endswith("._extra_state"):
            continue
        match = _MCORE_LAYER.match(key)
        try:
            if match:
                suffix = match.group(2)
                for local, fused in _MCORE_LOCAL_NORMS.items():
                    if suffix.startswith(local):
                        suffix = fused + suffix[len(local):]
                local_expert = _LOCAL_EXPERT.match(suffix)
                if local_expert:  # mlp.experts.local_experts.<j>.<linear>.weight
                    suffix = f"mlp.experts.experts.{local_expert.group(2)}"
                name = from_mcore(MCORE_LAYER_PREFIX + suffix, int(match.group(1)) + layer_offset)
                if local_expert:
                    experts.setdefault(name, {})[int(local_expert.group(1))] = value
                    continue
            else:
                name = from_mcore(key)
        except KeyError as exc:
            raise CheckpointError(f"Megatron Core checkpoint entry {key!r} is not part of the "
                                  f"GPT-2 this code builds: {exc}") from exc
        flat[name] = value
    for name, by_index in experts.items():
        if sorted(by_index) != list(range(len(by_index))):
            raise CheckpointError(f"Megatron Core checkpoint holds local experts "
                                  f"{sorted(by_index)} of {name}: expected 0 to "
                                  f"{len(by_index) - 1}")
        flat[name] = torch.stack([by_index[j] for j in range(len(by_index))])
    return flat
