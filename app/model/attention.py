"""Causal self-attention split by heads over tensor parallelism: MHA, GQA and MQA, with
learned-absolute, rotary or ALiBi positions and optional selective recompute.

Fused QKV layout (Megatron, checkpoint_version 3.0): the projection's output rows are grouped
by key/value group, each group holding its query heads, then its key head, then its value head:

    [groups, (q heads of the group, k, v), head_dim]

With one group per head (plain multi-head attention) that is `[heads, (q, k, v), head_dim]`.
When the groups are divisible by the tensor-parallel size a contiguous split of the rows gives
each rank whole groups. With fewer groups than TP ranks (e.g. multi-query attention at TP 2)
each group's key/value heads are replicated on TP/groups ranks: rank r holds its share of the
group's query heads followed by the group's k and v ([heads/tp + 2, head_dim] rows), and the
gradient of those k/v rows is summed over the ranks that share them
(`app.mpu.mappings.sum_gradient_over_tensor_parallel`). Initialisation draws the full
Megatron-layout weight from its seed either way, so the model is the same at any TP size.
"""
from __future__ import annotations

import functools
from typing import Optional, Protocol, Tuple

import torch
from torch import nn

from app.config import ModelConfig
from app.model import fused
from app.model.positions import RotaryTables, apply_rotary
from app.mpu import random as mpu_random
from app.mpu.context_parallel import ring_attention, ulysses_attention
from app.mpu.layers import (ColumnParallelLinear, InitMethod, RowParallelLinear,
                            set_tensor_model_parallel_attributes)
from app.mpu.mappings import sum_gradient_over_tensor_parallel
from app.mpu.parallel_state import ParallelState
from app.mpu.utils import divide
from app.utils.dtypes import torch_dtype


class InferenceCache(Protocol):
    """Key/value cache for incremental decoding (app.inference.kv_cache.KVCache implements it).

    `offset` is the number of tokens already cached. `append(layer_number, k, v)` stores this
    step's keys/values [b, kv heads/tp, s, hd] of a layer after those already cached and
    returns all of them [b, kv heads/tp, cached + s, hd].
    """

    offset: int

    def append(self, layer_number: int, key: torch.Tensor,
               value: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]: ...


def heads_per_partition(num_heads: int, num_kv_heads: int, tp: int) -> Tuple[int, int]:
    """(query heads, key/value heads) one tensor-parallel rank holds.

    Key/value heads are split when divisible by `tp`; when fewer than `tp` each rank holds the
    one group its query heads belong to (replicated on tp / num_kv_heads ranks).
    """
    heads = divide(num_heads, tp, "num_attention_heads", "tensor_model_parallel_size")
    if num_kv_heads >= tp:
        return heads, divide(num_kv_heads, tp, "num_query_groups", "tensor_model_parallel_size")
    divide(tp, num_kv_heads, "tensor_model_parallel_size", "num_query_groups")
    return heads, 1


def replicated_kv_init(full_init: InitMethod, num_heads: int, num_kv_heads: int, head_dim: int,
                       tp: int) -> InitMethod:
    """init_method for the [tp * (heads/tp + 2) * head_dim, h] stack of every rank's QKV rows
    when key/value heads are replicated: draws the full Megatron-layout weight with `full_init`
    and writes rank r's rows (its query heads of group r // (tp / groups), then that group's
    k and v) into slice r, so ColumnParallelLinear's contiguous split hands each rank its own."""
    local_heads, per_group = num_heads // tp, num_heads // num_kv_heads
    ranks_per_group = tp // num_kv_heads

    def init(stacked: torch.Tensor) -> torch.Tensor:
        hidden = stacked.shape[1]
        full = torch.empty(((num_heads + 2 * num_kv_heads) * head_dim, hidden))
        full_init(full)
        full = full.view(num_kv_heads, per_group + 2, head_dim, hidden)
        parts = []
        for rank in range(tp):
            group, share = divmod(rank, ranks_per_group)
            parts.append(full[group, share * local_heads:(share + 1) * local_heads])  # q
            parts.append(full[group, per_group:])  # k, v
        with torch.no_grad():
            return stacked.copy_(torch.cat(parts).view_as(stacked))
    return init


class ParallelAttention(nn.Module):
    """Causal self-attention [b, s, h] -> ([b, s, h], dense bias [h]) (the activations
    [b, s/tp, h] with sequence parallelism); the output projection's bias is returned, not
    added, for the caller's bias+dropout+add.

    forward(x, attention_mask, rotary, inference_cache): `attention_mask` is None (plain
    causal), a bool mask [b or 1, 1, s_q, s_k] with True = masked out, or a float additive bias
    [b or 1, heads/tp, s_q, s_k] with the masked positions already at the dtype's minimum
    (ALiBi); `fused.attention` picks SDPA or q k^T + fused softmax (config.attention_impl).
    `rotary` (cos, sin) tables rotate queries and keys (RoPE) before an `inference_cache`
    (incremental decoding) stores the keys and values and returns the cached ones too.
    Attention dropout runs inside the model-parallel RNG fork, since each rank's heads differ.
    With selective recompute of core_attn (--recompute-modules) the attention core (QK^T,
    softmax, dropout, AV) is recomputed in backward instead of keeping its activations.
    """

    def __init__(self, config: ModelConfig, parallel_state: ParallelState, qkv_init: InitMethod,
                 dense_init: InitMethod, layer_number: int = 0) -> None:
        super().__init__()
        tp, rank = parallel_state.tensor_model_parallel_size, parallel_state.tensor_model_parallel_rank
        nh, ng, hd = config.num_attention_heads, config.num_kv_heads, config.head_dim
        self.layer_number = layer_number
        self.heads, self.kv_heads = heads_per_partition(nh, ng, tp)
        self.head_dim = hd
        self.dropout_p = config.attention_dropout
        self.masked_softmax_fusion = config.masked_softmax_fusion
        self.attention_impl = config.attention_impl
        # --apply-query-key-layer-scaling: scores / (sqrt(hd) * n), multiplied back by n inside
        # an fp32 softmax (Megatron's fp16 overflow guard; n = 1-based layer number)
        self.qk_coeff = float(layer_number + 1) if config.apply_query_key_layer_scaling else 1.0
        self.softmax_in_fp32 = (config.attention_softmax_in_fp32
                                or config.apply_query_key_layer_scaling)
        self.selective_recompute = config.recomputes("core_attn")
        # context parallelism: this rank holds 2 of the sequence's 2C chunks; keys/values ring
        self.context = parallel_state if parallel_state.context_parallel_size > 1 else None
        self.cp_comm_type = parallel_state.cp_comm_type
        dtype = torch_dtype(config.params_dtype)
        h, sp = config.hidden_size, config.sequence_parallel
        local_rows = (self.heads + 2 * self.kv_heads) * hd
        replicated = ng < tp
        self.query_key_value = ColumnParallelLinear(  # bias: --add-qkv-bias or linear biases
            h, local_rows * tp, gather_output=False, bias=config.qkv_bias,
            init_method=replicated_kv_init(qkv_init, nh, ng, hd, tp) if replicated else qkv_init,
            parallel_state=parallel_state, params_dtype=dtype, sequence_parallel=sp)
        if replicated:  # k/v rows shared by tp / ng ranks: sum their gradients over those ranks
            for param in (self.query_key_value.weight, self.query_key_value.bias):
                if param is not None:
                    sum_gradient_over_tensor_parallel(
                        param, parallel_state, first_row=self.heads * hd,
                        replica_set=rank // (tp // ng), num_replica_sets=ng)
        # --qk-layernorm: one norm over head channels for all query heads, one for all key
        # heads; replicated over TP, each rank's gradient covers its heads: summed over TP
        self.q_layernorm = self.k_layernorm = None
        if config.qk_layernorm:
            self.q_layernorm, self.k_layernorm = (
                fused.norm(config.normalization, hd, config.layernorm_epsilon, dtype,
                           config.layernorm_fusion, config.layernorm_zero_centered_gamma)
                for _ in range(2))
            for param in (*self.q_layernorm.parameters(), *self.k_layernorm.parameters()):
                set_tensor_model_parallel_attributes(param, False)
                sum_gradient_over_tensor_parallel(param, parallel_state)
        self.dense = RowParallelLinear(
            nh * hd, h, input_is_parallel=True, bias=config.add_bias_linear,
            init_method=dense_init,
            parallel_state=parallel_state, params_dtype=dtype, skip_bias_add=True,
            sequence_parallel=sp)

    def forward(self, x: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                rotary: Optional[RotaryTables] = None,
                inference_cache: Optional[InferenceCache] = None
                ) -> Tuple[torch.Tensor, torch.Tensor]:
        qkv = self.query_key_value(x)  # [b, s, (nh + 2 ng) hd / tp], full sequence
        b, s = qkv.shape[:2]
        per_group = self.heads // self.kv_heads
        qkv = qkv.view(b, s, self.kv_heads, per_group + 2, self.head_dim)
        q, k, v = qkv.split([per_group, 1, 1], dim=3)
        # views for multi-head attention (per_group 1); a copy of q for grouped queries
        q = q.reshape(b, s, self.heads, self.head_dim).transpose(1, 2)  # [b, nh/tp, s, hd]
        k = k.squeeze(3).transpose(1, 2)  # [b, ng/tp, s, hd]
        v = v.squeeze(3).transpose(1, 2)  # [b, ng/tp, s, hd]
        if self.q_layernorm is not None:  # per head, before RoPE (Megatron Core)
            q, k = self.q_layernorm(q), self.k_layernorm(k)
        if rotary is not None:
            q, k = apply_rotary(q, rotary), apply_rotary(k, rotary)
        if inference_cache is not None:  # keys/values of earlier steps come first
            k, v = inference_cache.append(self.layer_number, k, v)  # [b, ng/tp, past + s, hd]
        dropout_p = self.dropout_p if self.training else 0.0
        if self.selective_recompute and self.training and torch.is_grad_enabled():
            # q, k, v hold this rank's heads: never partitioned over TP (DeepSpeed's option)
            core = functools.partial(self._core, attention_mask=attention_mask,
                                     dropout_p=dropout_p)
            context = mpu_random.checkpoint(core, q, k, v, inputs_replicated_over_tp=False)
        else:
            context = self._core(q, k, v, attention_mask, dropout_p)  # [b, nh/tp, s, hd]
        context = context.transpose(1, 2).reshape(b, s, self.heads * self.head_dim)
        return self.dense(context)  # [b, s, h] (or [b, s/tp, h] with SP), dense bias [h]

    def _core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              attention_mask: Optional[torch.Tensor], dropout_p: float) -> torch.Tensor:
        """The attention core, what selective recompute recomputes; [b, nh/tp, s, hd]."""
        if dropout_p > 0.0:
            with mpu_random.get_rng_tracker().fork():
                return self._attend(q, k, v, attention_mask, dropout_p)
        return self._attend(q, k, v, attention_mask, 0.0)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                attention_mask: Optional[torch.Tensor], dropout_p: float) -> torch.Tensor:
        """softmax(q k^T / sqrt(hd) (+ bias), masked) v with dropout on the probabilities.

        Without a mask, s_q == s_k is plain causal; queries after cached keys (decoding with an
        inference cache) get the bottom-right causal mask: query i sees keys 0..s_k - s_q + i.
        """
        if self.context is not None and self.cp_comm_type == "a2a":  # whole sequence, nh/C
            return ulysses_attention(q, k, v, self.context, functools.partial(
                self._attend_local, attention_mask=None, dropout_p=dropout_p))
        if self.context is not None:  # plain causal over the whole sequence's global indices
            return ring_attention(q, k, v, self.context, dropout_p)  # [b, nh/tp, s/C, hd]
        return self._attend_local(q, k, v, attention_mask, dropout_p)

    def _attend_local(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      attention_mask: Optional[torch.Tensor], dropout_p: float) -> torch.Tensor:
        """`_attend` on the keys/values this rank holds (no context parallelism)."""
        s_q, s_k = q.shape[2], k.shape[2]
        if attention_mask is None and s_q != s_k:
            rows = torch.arange(s_q, device=q.device).unsqueeze(1) + (s_k - s_q)
            attention_mask = torch.arange(s_k, device=q.device).unsqueeze(0) > rows  # [s_q, s_k]
            attention_mask = attention_mask.view(1, 1, s_q, s_k)
        return fused.attention(q, k, v, attention_mask, dropout_p, self.attention_impl,
                               self.masked_softmax_fusion, qk_coeff=self.qk_coeff,
                               softmax_in_fp32=self.softmax_in_fp32)  # [b, nh/tp, s, hd]
