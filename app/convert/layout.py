"""Where each GPT-2 parameter lives in a TP x PP layout: pure arithmetic, no files, no processes.

Names are ours (Megatron's, flat, global layer indices; see docs/architecture.md). A full
tensor is split into tensor-parallel shards along its partition dimension by contiguous
chunks, which is exactly what the parallel layers keep (the fused QKV rows are ordered
[heads, (q, k, v), head_dim], so a contiguous chunk holds whole heads); merging concatenates
the shards back, so split/merge round trips are exact. A pipeline stage holds layers
[stage * L/pp, (stage + 1) * L/pp); the first stage also holds the embeddings, the last the
final LayerNorm and, when PP > 1, a tied copy of the word embeddings (`word_embeddings.weight`).
"""
from __future__ import annotations

import re
from typing import Dict, List, Optional, Sequence, Tuple

import torch

WORD_EMBEDDINGS = "language_model.embedding.word_embeddings.weight"
POSITION_EMBEDDINGS = "language_model.embedding.position_embeddings.weight"
TIED_HEAD = "word_embeddings.weight"
FINAL_NORM = ("language_model.transformer.final_layernorm.weight",
              "language_model.transformer.final_layernorm.bias")
LAYER_PARAMS = (  # module order inside a layer, each module's weight before its bias
    "input_layernorm.weight", "input_layernorm.bias",
    "attention.query_key_value.weight", "attention.query_key_value.bias",
    "attention.dense.weight", "attention.dense.bias",
    "post_attention_layernorm.weight", "post_attention_layernorm.bias",
    "mlp.dense_h_to_4h.weight", "mlp.dense_h_to_4h.bias",
    "mlp.dense_4h_to_h.weight", "mlp.dense_4h_to_h.bias",
)
_LAYER_RE = re.compile(r"^language_model\.transformer\.layers\.(\d+)\.(.+)$")
_ROW_SPLIT = ("attention.query_key_value.weight", "attention.query_key_value.bias",
              "mlp.dense_h_to_4h.weight", "mlp.dense_h_to_4h.bias")
_COLUMN_SPLIT = ("attention.dense.weight", "mlp.dense_4h_to_h.weight")


class LayoutError(ValueError):
    """A parameter name or shape that the GPT-2 layout cannot place; the message names it."""


def layer_param_name(layer: int, suffix: str) -> str:
    """`language_model.transformer.layers.{layer}.{suffix}`."""
    return f"language_model.transformer.layers.{layer}.{suffix}"


def parse_layer(name: str) -> Optional[Tuple[int, str]]:
    """(global layer index, suffix) of a transformer-layer parameter; None for other names."""
    match = _LAYER_RE.match(name)
    return (int(match.group(1)), match.group(2)) if match else None


def partition_dim(name: str) -> int:
    """Dimension along which tensor parallelism splits `name`: 0 (rows), 1 (columns), -1 (none).

    Word embeddings (and the tied head copy) split their vocabulary rows; QKV and h->4h split
    their output rows and biases; attention.dense and 4h->h split their input columns; their
    biases, LayerNorms and position embeddings are replicated.
    """
    if name in (WORD_EMBEDDINGS, TIED_HEAD):
        return 0
    if name in (POSITION_EMBEDDINGS,) + FINAL_NORM:
        return -1
    parsed = parse_layer(name)
    if parsed is None or parsed[1] not in LAYER_PARAMS:
        raise LayoutError(f"parameter {name!r} is not part of the GPT-2 layout (expected "
                          "language_model.embedding.*, language_model.transformer.layers.N.*, "
                          "language_model.transformer.final_layernorm.* or word_embeddings.weight)")
    suffix = parsed[1]
    if suffix in _ROW_SPLIT:
        return 0
    if suffix in _COLUMN_SPLIT:
        return 1
    return -1


def split_tensor(full: torch.Tensor, name: str, tp: int) -> List[torch.Tensor]:
    """The `tp` contiguous shards of `full` along partition_dim(name) (replicas when -1)."""
    dim = partition_dim(name)
    if dim < 0 or tp == 1:
        return [full] * tp
    if full.shape[dim] % tp:
        raise LayoutError(f"{name}: dimension {dim} of shape {tuple(full.shape)} is not "
                          f"divisible by the tensor-parallel size {tp}")
    return [t.clone() for t in torch.chunk(full, tp, dim=dim)]


def merge_shards(shards: Sequence[torch.Tensor], name: str) -> torch.Tensor:
    """Inverse of split_tensor: concatenate along partition_dim(name), or check the replicas."""
    dim = partition_dim(name)
    if dim < 0 or len(shards) == 1:
        first = shards[0]
        for rank, other in enumerate(shards[1:], start=1):
            if other.shape != first.shape or not torch.equal(other, first):
                raise LayoutError(f"{name} is replicated across tensor-parallel ranks but rank "
                                  f"{rank}'s copy differs from rank 0's")
        return first
    return torch.cat(list(shards), dim=dim)


def stage_layer_range(num_layers: int, pp: int, stage: int) -> Tuple[int, int]:
    """Layers [start, end) of pipeline stage `stage` (L/pp each, as the trainer builds them)."""
    if num_layers % pp:
        raise LayoutError(f"num_layers ({num_layers}) is not divisible by the pipeline size ({pp})")
    per = num_layers // pp
    return stage * per, (stage + 1) * per


def stage_parameter_names(num_layers: int, pp: int, stage: int) -> List[str]:
    """Parameter names of one stage in module order (= its state_dict and optimizer order)."""
    names: List[str] = []
    if stage == 0:
        names += [WORD_EMBEDDINGS, POSITION_EMBEDDINGS]
    start, end = stage_layer_range(num_layers, pp, stage)
    for layer in range(start, end):
        names += [layer_param_name(layer, suffix) for suffix in LAYER_PARAMS]
    if stage == pp - 1:
        names += list(FINAL_NORM)
        if pp > 1:
            names.append(TIED_HEAD)
    return names


def model_parameter_names(num_layers: int) -> List[str]:
    """Every parameter of the whole model (one stage, no tied copy), in module order."""
    return stage_parameter_names(num_layers, 1, 0)


def stage_of(name: str, num_layers: int, pp: int) -> int:
    """The pipeline stage holding `name` (the tied head copy belongs to the last stage)."""
    if name in (WORD_EMBEDDINGS, POSITION_EMBEDDINGS):
        return 0
    if name in FINAL_NORM or name == TIED_HEAD:
        return pp - 1
    parsed = parse_layer(name)
    if parsed is None:
        partition_dim(name)  # raises with the name
    per = num_layers // pp
    return parsed[0] // per


def is_no_weight_decay(name: str) -> bool:
    """Biases and LayerNorm parameters (the optimizer's no-decay group), as get_param_groups."""
    return name.endswith(".bias") or "layernorm" in name


MUON_MATRICES = ("attention.query_key_value.weight", "attention.dense.weight",
                 "mlp.dense_h_to_4h.weight", "mlp.dense_4h_to_h.weight")
"""The layer weights --optimizer muon orthogonalises (app.optim.get_muon_param_groups)."""


def optimizer_groups(names: Sequence[str], muon: bool = False) -> Dict[str, List[str]]:
    """{'decay': [...], 'no_decay': [...]}: `names` split as app.optim.get_param_groups does;
    with `muon`, {'muon', 'decay', 'no_decay'} as app.optim.get_muon_param_groups does (the
    transformer layers' MUON_MATRICES first)."""
    chosen = [n for n in names if muon and (parse_layer(n) or (0, ""))[1] in MUON_MATRICES]
    rest = [n for n in names if n not in chosen]
    groups = {"muon": chosen} if muon else {}
    groups.update(decay=[n for n in rest if not is_no_weight_decay(n)],
                  no_decay=[n for n in rest if is_no_weight_decay(n)])
    return groups


def resize_vocab(tensor: torch.Tensor, rows: int, vocab_size: Optional[int], name: str
                 ) -> torch.Tensor:
    """`tensor` [V, ...] with `rows` rows: padding rows appended as zeros, or dropped.

    Only padding rows (index >= vocab_size, the tokenizer's size) may be dropped; a request
    that would cut real tokens raises LayoutError naming the sizes.
    """
    have = tensor.shape[0]
    if rows == have:
        return tensor
    if rows < have:
        if vocab_size is not None and rows < vocab_size:
            raise LayoutError(f"{name}: cannot shrink the vocabulary to {rows} rows; the "
                              f"tokenizer has {vocab_size} tokens")
        return tensor[:rows].clone()
    pad = torch.zeros((rows - have,) + tuple(tensor.shape[1:]), dtype=tensor.dtype)
    return torch.cat([tensor, pad], dim=0)
