"""Megatron-LM's GPT-2, built from the tensor-parallel layers of `app.mpu`.

    ids [b, s] -> word + position embeddings (+ dropout)          [b, s, h]     (first stage)
      -> L pre-LN layers: x + drop(attn(LN(x))); x + drop(mlp(LN(x)))  [b, s, h]
      -> final LayerNorm -> logits = x @ E^T (tied)                [b, s, V/tp]  (last stage)
      -> vocab-parallel cross-entropy with the labels             [b, s] fp32

Parameter names are Megatron's with *global* layer indices, so a pipeline stage holding layers
[start, end) names them exactly as the whole model does. Every parameter's initial value is a
pure function of (config.seed, its global name) (see `param_seed`): the full tensor is drawn from
its own `torch.Generator` and each tensor-parallel rank keeps its shard, so init is the same at
any TP / PP and in any construction order. Nothing here imports `torch.distributed`; the
parallelism lives in the `app.mpu` layers and mappings.
"""
from __future__ import annotations

import hashlib
import math
from typing import Callable, List, Optional, Protocol, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from torch import nn

from app.config import ModelConfig
from app.model import fused
from app.mpu import random as mpu_random
from app.mpu.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from app.mpu.mappings import copy_to_tensor_model_parallel_region
from app.mpu.parallel_state import ParallelState, get_parallel_state
from app.mpu.utils import divide
from app.utils.dtypes import torch_dtype

WORD_EMBEDDINGS = "language_model.embedding.word_embeddings.weight"
POSITION_EMBEDDINGS = "language_model.embedding.position_embeddings.weight"
InitMethod = Callable[[torch.Tensor], torch.Tensor]


class InferenceCache(Protocol):
    """Key/value cache for incremental decoding (app.inference.kv_cache.KVCache implements it).

    `append(layer_number, k, v)` stores this step's keys/values [b, nh/tp, s, hd] of a layer
    after those already cached and returns all of them [b, nh/tp, cached + s, hd].
    """

    def append(self, layer_number: int, key: torch.Tensor,
               value: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]: ...


# ---- initialisation ----------------------------------------------------------------------------
def param_seed(seed: int, global_name: str) -> int:
    """A 63-bit generator seed that depends only on `seed` and the parameter's global name."""
    digest = hashlib.sha256(f"{seed}:{global_name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def normal_init(std: float, seed: int, global_name: str) -> InitMethod:
    """init_method filling a full tensor in place with N(0, std) from the parameter's own generator.

    The values are drawn in fp32 on the CPU and then copied, so they do not depend on the
    tensor's dtype or device.
    """
    def init(tensor: torch.Tensor) -> torch.Tensor:
        gen = torch.Generator().manual_seed(param_seed(seed, global_name))
        values = torch.empty(tensor.shape, dtype=torch.float32).normal_(0.0, std, generator=gen)
        with torch.no_grad():
            return tensor.copy_(values)
    return init


class ParamInit:
    """Init closures of one model: N(0, std), and N(0, std/sqrt(2L)) for output projections."""

    def __init__(self, config: ModelConfig) -> None:
        self.seed = config.seed
        self.std = config.init_method_std
        self.output_std = config.init_method_std / math.sqrt(2.0 * config.num_layers)

    def normal(self, global_name: str) -> InitMethod:
        return normal_init(self.std, self.seed, global_name)

    def scaled_normal(self, global_name: str) -> InitMethod:
        return normal_init(self.output_std, self.seed, global_name)


def _layer_norm(config: ModelConfig, dtype: torch.dtype) -> nn.LayerNorm:
    """LayerNorm(h) with weight 1, bias 0, marked replicated across tensor-parallel ranks."""
    norm = fused.LayerNorm(config.hidden_size, eps=config.layernorm_epsilon, dtype=dtype,
                           use_kernel=config.layernorm_fusion)
    for param in norm.parameters():
        param.tensor_model_parallel = False
        param.partition_dim = -1
    return norm


def _dropout(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """Dropout that is a no-op (no kernel launched) when p == 0 or in eval mode."""
    return F.dropout(x, p, True) if (training and p > 0.0) else x


# ---- modules -----------------------------------------------------------------------------------
class Embedding(nn.Module):
    """Token + learned position embeddings, then dropout: ids [b, s] -> [b, s, h].

    Word embeddings are vocab-parallel ([V/tp, h] per rank); position embeddings are replicated.
    """

    def __init__(self, config: ModelConfig, parallel_state: ParallelState, init: ParamInit) -> None:
        super().__init__()
        dtype = torch_dtype(config.params_dtype)
        self.word_embeddings = VocabParallelEmbedding(
            config.padded_vocab_size, config.hidden_size, init_method=init.normal(WORD_EMBEDDINGS),
            parallel_state=parallel_state, params_dtype=dtype)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings,
                                                config.hidden_size, dtype=dtype)
        init.normal(POSITION_EMBEDDINGS)(self.position_embeddings.weight)
        self.position_embeddings.weight.tensor_model_parallel = False
        self.position_embeddings.weight.partition_dim = -1
        self.dropout_p = config.hidden_dropout

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        words = self.word_embeddings(input_ids)  # [b, s, h]
        positions = self.position_embeddings(position_ids)  # [b, s, h]
        return _dropout(words + positions, self.dropout_p, self.training)


class ParallelAttention(nn.Module):
    """Causal self-attention with a fused QKV projection split by heads over tensor parallelism.

    [b, s, h] -> ([b, s, h], dense bias [h]): the output projection's bias is returned, not
    added, for the caller's bias+dropout+add. The QKV output rows are ordered
    [heads, (q, k, v), head_dim], so each tensor-parallel rank holds whole heads.
    `attention_mask` None means plain causal; otherwise a bool mask [b or 1, 1, s, s], True =
    masked out. `fused.attention` picks SDPA or q k^T + fused softmax (config.attention_impl).
    Attention dropout runs inside the model-parallel RNG fork, since each rank's heads differ.
    """

    def __init__(self, config: ModelConfig, parallel_state: ParallelState, init: ParamInit,
                 prefix: str, layer_number: int = 0) -> None:
        super().__init__()
        tp = parallel_state.tensor_model_parallel_size
        self.heads_per_partition = divide(config.num_attention_heads, tp, "num_attention_heads",
                                          "tensor_model_parallel_size")
        self.head_dim = config.head_dim
        self.dropout_p = config.attention_dropout
        self.masked_softmax_fusion = config.masked_softmax_fusion
        self.attention_impl = config.attention_impl
        # --apply-query-key-layer-scaling: scores / (sqrt(hd) * n), multiplied back by n inside
        # an fp32 softmax (Megatron's fp16 overflow guard; n = 1-based layer number)
        self.qk_coeff = float(layer_number + 1) if config.apply_query_key_layer_scaling else 1.0
        self.softmax_in_fp32 = (config.attention_softmax_in_fp32
                                or config.apply_query_key_layer_scaling)
        dtype = torch_dtype(config.params_dtype)
        h = config.hidden_size
        self.query_key_value = ColumnParallelLinear(
            h, 3 * h, gather_output=False,
            init_method=init.normal(f"{prefix}.query_key_value.weight"),
            parallel_state=parallel_state, params_dtype=dtype)
        self.dense = RowParallelLinear(
            h, h, input_is_parallel=True, init_method=init.scaled_normal(f"{prefix}.dense.weight"),
            parallel_state=parallel_state, params_dtype=dtype, skip_bias_add=True)

    def forward(self, x: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                inference_cache: Optional[InferenceCache] = None,
                layer_number: int = 0) -> Tuple[torch.Tensor, torch.Tensor]:
        b, s, _ = x.shape
        qkv = self.query_key_value(x)  # [b, s, 3h/tp]
        qkv = qkv.view(b, s, self.heads_per_partition, 3, self.head_dim)
        # Views, no copy; in backward unbind's stack writes the [b, s, nh/tp, 3, hd] grad directly.
        q, k, v = (t.transpose(1, 2) for t in qkv.unbind(3))  # 3 x [b, nh/tp, s, hd]
        if inference_cache is not None:  # keys/values of earlier steps come first
            k, v = inference_cache.append(layer_number, k, v)  # 2 x [b, nh/tp, past + s, hd]
        dropout_p = self.dropout_p if self.training else 0.0
        if dropout_p > 0.0:
            with mpu_random.get_rng_tracker().fork():
                context = self._attend(q, k, v, attention_mask, dropout_p)
        else:
            context = self._attend(q, k, v, attention_mask, 0.0)  # [b, nh/tp, s, hd]
        context = context.transpose(1, 2).reshape(b, s, self.heads_per_partition * self.head_dim)
        return self.dense(context)  # [b, s, h], [h]

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                attention_mask: Optional[torch.Tensor], dropout_p: float) -> torch.Tensor:
        """softmax(q k^T / sqrt(hd), masked) v with dropout on the probabilities. [b, n, s_q, hd].

        Without a mask, s_q == s_k is plain causal; queries after cached keys (decoding with an
        inference cache) get the bottom-right causal mask: query i sees keys 0..s_k - s_q + i.
        """
        s_q, s_k = q.shape[2], k.shape[2]
        if attention_mask is None and s_q != s_k:
            rows = torch.arange(s_q, device=q.device).unsqueeze(1) + (s_k - s_q)
            attention_mask = torch.arange(s_k, device=q.device).unsqueeze(0) > rows  # [s_q, s_k]
            attention_mask = attention_mask.view(1, 1, s_q, s_k)
        return fused.attention(q, k, v, attention_mask, dropout_p, self.attention_impl,
                               self.masked_softmax_fusion, qk_coeff=self.qk_coeff,
                               softmax_in_fp32=self.softmax_in_fp32)


class ParallelMLP(nn.Module):
    """h -> ffn (column-parallel) -> bias+GeLU -> h (row-parallel, TP-reduced).

    [b, s, h] -> ([b, s, h], output bias [h]): the last bias is returned for bias+dropout+add.
    """

    def __init__(self, config: ModelConfig, parallel_state: ParallelState, init: ParamInit,
                 prefix: str) -> None:
        super().__init__()
        dtype = torch_dtype(config.params_dtype)
        self.openai_gelu = config.openai_gelu
        # The bias goes to the fused bias+GeLU op where that op is fused (CUDA); otherwise it
        # stays inside the GEMM (addmm), which is cheaper than a separate add.
        self.bias_gelu_flag = config.bias_gelu_fusion
        self.bias_gelu_fusion = fused.bias_gelu_fusion_applies(config.bias_gelu_fusion)
        self.dense_h_to_4h = ColumnParallelLinear(
            config.hidden_size, config.ffn_hidden_size, gather_output=False,
            init_method=init.normal(f"{prefix}.dense_h_to_4h.weight"),
            parallel_state=parallel_state, params_dtype=dtype,
            skip_bias_add=self.bias_gelu_fusion)
        self.dense_4h_to_h = RowParallelLinear(
            config.ffn_hidden_size, config.hidden_size, input_is_parallel=True,
            init_method=init.scaled_normal(f"{prefix}.dense_4h_to_h.weight"),
            parallel_state=parallel_state, params_dtype=dtype, skip_bias_add=True)

    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        if self.bias_gelu_fusion:
            intermediate, bias = self.dense_h_to_4h(x)  # [b, s, ffn/tp], [ffn/tp]
            intermediate = fused.bias_gelu(bias, intermediate, self.openai_gelu)
        else:
            intermediate = fused.bias_gelu(None, self.dense_h_to_4h(x), self.openai_gelu,
                                           self.bias_gelu_flag)  # [b, s, ffn/tp]
        return self.dense_4h_to_h(intermediate)  # [b, s, h], [h]


class ParallelTransformerLayer(nn.Module):
    """Pre-LN block: x + drop(attention(LN(x))), then x + drop(mlp(LN(x))). [b,s,h] -> [b,s,h].

    Each "x + drop(out + bias)" is `fused.bias_dropout_add` (--bias-dropout-fusion).
    """

    def __init__(self, config: ModelConfig, parallel_state: ParallelState, init: ParamInit,
                 layer_number: int) -> None:
        super().__init__()
        prefix = f"language_model.transformer.layers.{layer_number}"
        dtype = torch_dtype(config.params_dtype)
        self.layer_number = layer_number
        self.dropout_p = config.hidden_dropout
        self.bias_dropout_fusion = config.bias_dropout_fusion
        self.input_layernorm = _layer_norm(config, dtype)
        self.attention = ParallelAttention(config, parallel_state, init, f"{prefix}.attention",
                                           layer_number)
        self.post_attention_layernorm = _layer_norm(config, dtype)
        self.mlp = ParallelMLP(config, parallel_state, init, f"{prefix}.mlp")

    def forward(self, x: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                inference_cache: Optional[InferenceCache] = None) -> torch.Tensor:
        attn, attn_bias = self.attention(self.input_layernorm(x), attention_mask, inference_cache,
                                         self.layer_number)  # [b, s, h], [h]
        x = fused.bias_dropout_add(attn, attn_bias, x, self.dropout_p, self.training,
                                   self.bias_dropout_fusion)  # [b, s, h]
        mlp, mlp_bias = self.mlp(self.post_attention_layernorm(x))  # [b, s, h], [h]
        return fused.bias_dropout_add(mlp, mlp_bias, x, self.dropout_p, self.training,
                                      self.bias_dropout_fusion)


class ParallelTransformer(nn.Module):
    """Layers [start, end) keyed by their global index, plus the final LayerNorm on the last stage.

    With `config.checkpoint_activations` (and grad enabled in training) chunks of
    `checkpoint_num_layers` layers are recomputed in backward via `app.mpu.random.checkpoint`,
    which restores the RNG states so dropout masks repeat exactly.
    """

    def __init__(self, config: ModelConfig, parallel_state: ParallelState, init: ParamInit,
                 layer_range: Tuple[int, int], post_process: bool) -> None:
        super().__init__()
        start, end = layer_range
        self.layers = nn.ModuleDict({
            str(i): ParallelTransformerLayer(config, parallel_state, init, i)
            for i in range(start, end)})
        self.checkpoint_activations = config.checkpoint_activations
        self.checkpoint_num_layers = config.checkpoint_num_layers
        if post_process:
            self.final_layernorm = _layer_norm(config, torch_dtype(config.params_dtype))
        else:
            self.final_layernorm = None

    def forward(self, hidden: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                inference_cache: Optional[InferenceCache] = None) -> torch.Tensor:
        layers: List[nn.Module] = list(self.layers.values())
        if (self.checkpoint_activations and self.training and torch.is_grad_enabled()
                and inference_cache is None):
            n = self.checkpoint_num_layers
            for first in range(0, len(layers), n):
                chunk = _ChunkForward(layers[first:first + n], attention_mask)
                hidden = mpu_random.checkpoint(chunk, hidden)  # [b, s, h]
        else:
            for layer in layers:
                hidden = layer(hidden, attention_mask, inference_cache)  # [b, s, h]
        if self.final_layernorm is not None:
            hidden = self.final_layernorm(hidden)
        return hidden


class _ChunkForward:
    """Runs a chunk of layers with a fixed mask: what activation checkpointing recomputes."""

    def __init__(self, layers: Sequence[nn.Module], attention_mask: Optional[torch.Tensor]) -> None:
        self.layers, self.attention_mask = layers, attention_mask

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            hidden = layer(hidden, self.attention_mask)
        return hidden


class TransformerLanguageModel(nn.Module):
    """Embedding (first stage) + this stage's transformer layers (+ final LayerNorm, last stage)."""

    def __init__(self, config: ModelConfig, parallel_state: ParallelState, init: ParamInit,
                 pre_process: bool, post_process: bool, layer_range: Tuple[int, int]) -> None:
        super().__init__()
        self.embedding = Embedding(config, parallel_state, init) if pre_process else None
        self.transformer = ParallelTransformer(config, parallel_state, init, layer_range,
                                               post_process)


class GPT2Model(nn.Module):
    """GPT-2 (Megatron-LM), or one pipeline stage of it when pre_process/post_process are False.

    forward(input_ids [b, s], position_ids [b, s], attention_mask=None, labels=None,
    inference_cache=None):
    - with `post_process` and `labels`: per-token loss [b, s] fp32 (no reduction, no loss mask);
    - with `post_process`, no labels: logits [b, s, V/tp] (this rank's vocab shard);
    - without `post_process`: hidden states [b, s, h] for the next stage.
    `parallel_state=None` means `app.mpu.parallel_state.get_parallel_state()` (the one-process
    state unless `initialize_model_parallel` ran). Stages without `pre_process` take their input
    from `set_input_tensor`. The last stage holds
    the tied output embedding: the first stage's word embeddings, or, when it has no embedding,
    its own `word_embeddings.weight` initialised to the same values (flag `shared = True`; the
    pipeline keeps the two equal by all-reducing their gradients over the embedding group).
    With an `inference_cache` (incremental decoding) the inputs are the new tokens only, their
    `position_ids` follow the cached ones, and each layer attends to its cached keys too.
    """

    def __init__(self, config: ModelConfig, parallel_state: Optional[ParallelState] = None, *,
                 pre_process: bool = True, post_process: bool = True,
                 layer_range: Optional[Tuple[int, int]] = None) -> None:
        super().__init__()
        self.config = config
        self.parallel_state = parallel_state if parallel_state is not None else get_parallel_state()
        self.pre_process, self.post_process = pre_process, post_process
        self.layer_range = _check_layer_range(layer_range, config.num_layers)
        init = ParamInit(config)
        self.language_model = TransformerLanguageModel(
            config, self.parallel_state, init, pre_process, post_process, self.layer_range)
        self.word_embeddings: Optional[VocabParallelEmbedding] = None
        if post_process and not pre_process:
            self.word_embeddings = VocabParallelEmbedding(
                config.padded_vocab_size, config.hidden_size,
                init_method=init.normal(WORD_EMBEDDINGS), parallel_state=self.parallel_state,
                params_dtype=torch_dtype(config.params_dtype))
            self.word_embeddings.weight.shared = True
        self.input_tensor: Optional[torch.Tensor] = None

    def set_input_tensor(self,
                         input_tensor: Union[torch.Tensor, Sequence[torch.Tensor], None]) -> None:
        """Hidden states [b, s, h] from the previous stage (a one-element list is accepted)."""
        if isinstance(input_tensor, (list, tuple)):
            if len(input_tensor) != 1:
                raise ValueError(f"expected one input tensor, got {len(input_tensor)}")
            input_tensor = input_tensor[0]
        self.input_tensor = input_tensor

    def word_embeddings_weight(self) -> torch.Tensor:
        """The tied embedding [V/tp, h] used for the logits (and, on stage 0, the lookup)."""
        if self.pre_process:
            return self.language_model.embedding.word_embeddings.weight
        if self.word_embeddings is None:
            raise RuntimeError("word_embeddings_weight() called on a stage without embeddings")
        return self.word_embeddings.weight

    def forward(self, input_ids: Optional[torch.Tensor],
                position_ids: Optional[torch.Tensor] = None,
                attention_mask: Optional[torch.Tensor] = None,
                labels: Optional[torch.Tensor] = None,
                inference_cache: Optional[InferenceCache] = None) -> torch.Tensor:
        if self.pre_process:
            if position_ids is None:
                seq = torch.arange(input_ids.shape[1], device=input_ids.device)
                position_ids = seq.unsqueeze(0)  # [1, s], broadcast over the batch
            hidden = self.language_model.embedding(input_ids, position_ids)  # [b, s, h]
        else:
            if self.input_tensor is None:
                raise RuntimeError(
                    "this pipeline stage has no embedding: call set_input_tensor() first")
            hidden = self.input_tensor
        hidden = self.language_model.transformer(hidden, attention_mask,
                                                 inference_cache)  # [b, s, h]
        if not self.post_process:
            return hidden
        hidden = copy_to_tensor_model_parallel_region(hidden, self.parallel_state)
        logits = F.linear(hidden, self.word_embeddings_weight())  # [b, s, V/tp]
        if labels is None:
            return logits.float()  # callers get fp32 logits whatever the weights' dtype
        return lm_loss(logits, labels, self.parallel_state,
                       in_fp32=not self.config.fp16_lm_cross_entropy,
                       fusion=self.config.cross_entropy_loss_fusion)  # [b, s] fp32


def lm_loss(logits: torch.Tensor, labels: torch.Tensor, parallel_state: ParallelState,
            in_fp32: bool = True, fusion: bool = True) -> torch.Tensor:
    """Per-token fp32 cross-entropy of vocab-split logits [b, s, V/tp] against labels [b, s].

    `fused.cross_entropy`: the CUDA kernels with `fusion` (--cross-entropy-loss-fusion; fp32
    arithmetic on the logits' own dtype, no fp32 copy); else the logits upcast to fp32 (kept
    in their dtype with `in_fp32` False: --fp16-lm-cross-entropy) through PyTorch's row-fused
    `F.cross_entropy` at one tensor-parallel rank (same values as
    `vocab_parallel_cross_entropy`, fewer passes over [b*s, V]: ~6% faster LM head on CPU), or
    `vocab_parallel_cross_entropy` across ranks.
    """
    return fused.cross_entropy(logits, labels, parallel_state, use_kernel=fusion,
                               in_fp32=in_fp32)


def _check_layer_range(layer_range: Optional[Tuple[int, int]], num_layers: int) -> Tuple[int, int]:
    """Default (0, L); otherwise validate 0 <= start <= end <= L with a message naming them."""
    if layer_range is None:
        return 0, num_layers
    start, end = int(layer_range[0]), int(layer_range[1])
    if not 0 <= start <= end <= num_layers:
        raise ValueError(f"layer_range ({start}, {end}) must satisfy 0 <= start <= end <= "
                         f"num_layers ({num_layers})")
    return start, end
