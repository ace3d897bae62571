"""Megatron-LM's GPT-2, built from the tensor-parallel layers of `app.mpu`.

    ids [b, s] -> word (+ learned position) embeddings (+ dropout)  [b, s, h]     (first stage)
      -> L pre-LN layers: x + drop(attn(LN(x))); x + drop(mlp(LN(x)))  [b, s, h]
      -> final LayerNorm -> logits = x @ E^T (tied) or output layer  [b, s, V/tp]  (last stage)
      -> vocab-parallel cross-entropy with the labels             [b, s] fp32

With sequence parallelism every [b, s, h] above outside the attention and MLP cores is this
rank's [b, s/tp, h] slice of the sequence: LayerNorm, dropout and the residual run on 1/tp of
the tokens; the column-parallel linears all-gather their input along s and the row-parallel
ones reduce-scatter their output. Dropout there uses the model-parallel RNG stream (each rank
holds other tokens), and the gradients of the replicated LayerNorm and bias parameters in that
region are summed over TP. Attention (app.model.attention) takes RoPE tables or an ALiBi bias
computed once per forward (app.model.positions).

Parameter names are Megatron's with *global* layer indices, so a pipeline stage holding layers
[start, end) names them exactly as the whole model does. Every parameter's initial value is a
pure function of (config.seed, its global name) (see `param_seed`): the full tensor is drawn from
its own `torch.Generator` and each tensor-parallel rank keeps its shard, so init is the same at
any TP / PP and in any construction order. Nothing here imports `torch.distributed`; the
parallelism lives in the `app.mpu` layers and mappings.
"""
from __future__ import annotations

import contextlib
import hashlib
import math
from typing import Callable, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from torch import nn

from app.config import ModelConfig, recompute_plan
from app.config.param_names import LAYER_PREFIX, OUTPUT_LAYER, POSITION_EMBEDDINGS, WORD_EMBEDDINGS
from app.model import fused
from app.model.attention import InferenceCache, ParallelAttention
from app.model.mlp import ParallelMLP
from app.model.moe.layer import MoELayer
from app.model.positions import RotaryEmbedding, RotaryTables, alibi_bias, alibi_slopes
from app.mpu import random as mpu_random
from app.mpu.layers import (ColumnParallelLinear, VocabParallelEmbedding,
                            column_parallel_linear, set_tensor_model_parallel_attributes)
from app.mpu.mappings import (scatter_to_sequence_parallel_region,
                              sum_gradient_over_tensor_parallel)
from app.mpu.parallel_state import ParallelState, get_parallel_state
from app.utils.dtypes import torch_dtype

InitMethod = Callable[[torch.Tensor], torch.Tensor]


# ---- initialisation ----------------------------------------------------------------------------
def param_seed(seed: int, global_name: str) -> int:
    """A 63-bit generator seed that depends only on `seed` and the parameter's global name."""
    digest = hashlib.sha256(f"{seed}:{global_name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def normal_init(std: float, seed: int, global_name: str) -> InitMethod:
    """init_method filling a full tensor in place with N(0, std) from the parameter's own generator.

    The values are drawn in fp32 on the CPU and then copied, so they do not depend on the
    tensor's dtype or device. A tensor on the meta device (a build for its structure only,
    app.model.stage.stage_parameters) has no values and is returned as it is.
    """
    def init(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.is_meta:
            return tensor
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


def _layer_norm(config: ModelConfig, dtype: torch.dtype,
                parallel_state: ParallelState) -> nn.Module:
    """LayerNorm(h) with weight 1, bias 0 (or RMSNorm(h), --normalization), marked replicated
    across tensor-parallel ranks (with sequence parallelism each rank normalises other tokens,
    so the gradients are summed)."""
    norm = fused.norm(config.normalization, config.hidden_size, config.layernorm_epsilon,
                      dtype, config.layernorm_fusion, config.layernorm_zero_centered_gamma)
    for param in norm.parameters():
        set_tensor_model_parallel_attributes(param, False)
        if config.sequence_parallel:
            sum_gradient_over_tensor_parallel(param, parallel_state)
    return norm


def _dropout(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """Dropout that is a no-op (no kernel launched) when p == 0 or in eval mode."""
    return F.dropout(x, p, True) if (training and p > 0.0) else x


def _hidden_dropout_rng(sequence_parallel: bool, p: float, training: bool):
    """Context for dropout on hidden states: the model-parallel RNG stream for sequence-parallel
    slices (each TP rank holds other tokens), else the default stream (identical on TP ranks)."""
    if sequence_parallel and training and p > 0.0:
        return mpu_random.get_rng_tracker().fork()
    return contextlib.nullcontext()


# ---- modules -----------------------------------------------------------------------------------
class PositionEmbedding(nn.Embedding):
    """The learned position table [max_positions, h], replicated over TP, filled by
    `init_method` inside its own __init__: a construction context that takes each module's
    parameters as its __init__ returns (ZeRO-3's deepspeed.zero.Init) sees the final values."""

    def __init__(self, num_positions: int, hidden_size: int, dtype: torch.dtype,
                 init_method: InitMethod) -> None:
        # nn.Embedding's own init draws from the global RNG, and the dropout streams that
        # follow depend on it, so it stays; a meta-device build has nothing to draw
        table = torch.empty(num_positions, hidden_size, dtype=dtype)
        super().__init__(num_positions, hidden_size, dtype=dtype,
                         _weight=table if table.is_meta else None)
        init_method(self.weight)
        set_tensor_model_parallel_attributes(self.weight, False)


class Embedding(nn.Module):
    """Token (+ learned position) embeddings, then dropout: ids [b, s] -> [b, s, h].

    Word embeddings are vocab-parallel ([V/tp, h] per rank); the position table (only for
    learned_absolute positions) is replicated. With sequence parallelism the output is this
    rank's [b, s/tp, h] slice: word + position embeddings are split along s after the TP
    all-reduce, or, without a position table, the word embeddings are reduce-scattered directly.
    """

    def __init__(self, config: ModelConfig, parallel_state: ParallelState, init: ParamInit) -> None:
        super().__init__()
        dtype = torch_dtype(config.params_dtype)
        self.parallel_state = parallel_state
        self.sequence_parallel = config.sequence_parallel
        learned = config.position_embedding_type == "learned_absolute"
        self.word_embeddings = VocabParallelEmbedding(
            config.padded_vocab_size, config.hidden_size, init_method=init.normal(WORD_EMBEDDINGS),
            parallel_state=parallel_state, params_dtype=dtype,
            reduce_scatter_embeddings=config.sequence_parallel and not learned)
        self.position_embeddings: Optional[nn.Embedding] = None
        if learned:
            self.position_embeddings = PositionEmbedding(
                config.max_position_embeddings, config.hidden_size, dtype,
                init.normal(POSITION_EMBEDDINGS))
        self.dropout_p = config.hidden_dropout

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.word_embeddings(input_ids)  # [b, s, h] ([b, s/tp, h] if reduce-scattered)
        if self.position_embeddings is not None:
            hidden = hidden + self.position_embeddings(position_ids)  # [b, s, h]
            if self.sequence_parallel:
                hidden = scatter_to_sequence_parallel_region(hidden, self.parallel_state)
        with _hidden_dropout_rng(self.sequence_parallel, self.dropout_p, self.training):
            return _dropout(hidden, self.dropout_p, self.training)


class ParallelTransformerLayer(nn.Module):
    """Pre-LN block: x + drop(attention(LN(x))), then x + drop(mlp(LN(x))). [b,s,h] -> [b,s,h]
    ([b, s/tp, h] with sequence parallelism, the dropout then on the model-parallel stream).

    Each "x + drop(out + bias)" is `fused.bias_dropout_add` (--bias-dropout-fusion).
    """

    def __init__(self, config: ModelConfig, parallel_state: ParallelState, init: ParamInit,
                 layer_number: int) -> None:
        super().__init__()
        prefix = f"{LAYER_PREFIX}.{layer_number}"
        dtype = torch_dtype(config.params_dtype)
        self.layer_number = layer_number
        self.dropout_p = config.hidden_dropout
        self.sequence_parallel = config.sequence_parallel
        self.bias_dropout_fusion = config.bias_dropout_fusion
        self.input_layernorm = _layer_norm(config, dtype, parallel_state)
        self.attention = ParallelAttention(
            config, parallel_state, init.normal(f"{prefix}.attention.query_key_value.weight"),
            init.scaled_normal(f"{prefix}.attention.dense.weight"), layer_number)
        self.post_attention_layernorm = _layer_norm(config, dtype, parallel_state)
        is_moe = config.moe.layer_pattern(config.num_layers)[layer_number]  # --moe-layer-freq
        if is_moe:
            self.mlp: nn.Module = MoELayer(config, parallel_state, init, f"{prefix}.mlp",
                                           layer_number)
        else:
            self.mlp = ParallelMLP(config, parallel_state, init, f"{prefix}.mlp")
        self.recompute_mlp = config.recomputes("moe" if is_moe else "mlp")

    def forward(self, x: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                rotary: Optional[RotaryTables] = None,
                inference_cache: Optional[InferenceCache] = None) -> torch.Tensor:
        attn, attn_bias = self.attention(self.input_layernorm(x), attention_mask, rotary,
                                         inference_cache)  # [b, s, h], [h]
        with _hidden_dropout_rng(self.sequence_parallel, self.dropout_p, self.training):
            x = fused.bias_dropout_add(attn, attn_bias, x, self.dropout_p, self.training,
                                       self.bias_dropout_fusion)  # [b, s, h]
        mlp, mlp_bias = self._mlp(self.post_attention_layernorm(x))  # [b, s, h], [h]
        with _hidden_dropout_rng(self.sequence_parallel, self.dropout_p, self.training):
            return fused.bias_dropout_add(mlp, mlp_bias, x, self.dropout_p, self.training,
                                          self.bias_dropout_fusion)


    def _mlp(self, x: torch.Tensor) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The MLP (or MoE layer) on x [b, s, h]; with selective recompute of mlp (moe) run
        through `app.mpu.random.checkpoint`, recomputed in backward. Its output bias is a
        parameter (or None), returned as is, outside the checkpoint."""
        if not (self.recompute_mlp and self.training and torch.is_grad_enabled()):
            return self.mlp(x)
        biases: List[Optional[torch.Tensor]] = []

        def output(hidden: torch.Tensor) -> torch.Tensor:
            out, bias = self.mlp(hidden)
            biases.append(bias)
            return out
        out = mpu_random.checkpoint(output, x, inputs_replicated_over_tp=not self.sequence_parallel)
        return out, biases[0]


class ParallelTransformer(nn.Module):
    """Layers [start, end) keyed by their global index, plus the final LayerNorm on the last stage.

    With full recompute (in training, grad enabled) layers run through
    `app.mpu.random.checkpoint`, which recomputes them in backward with the RNG states restored
    so dropout masks repeat exactly, in the chunks `app.config.recompute_plan` gives for these
    layers (uniform: chunks of recompute_num_layers layers; block: the first
    recompute_num_layers layers one by one, the others kept). (Selective recompute lives in the
    layer's modules: the attention core, the MLP, the MoE layer.) Under sequence
    parallelism a layer's input is this rank's slice of the sequence, different on each TP
    rank, so it never goes to DeepSpeed's partitioned checkpointing (which assumes inputs
    replicated over TP and would rebuild them from the other ranks' slices).
    """

    def __init__(self, config: ModelConfig, parallel_state: ParallelState, init: ParamInit,
                 layer_range: Tuple[int, int], post_process: bool) -> None:
        super().__init__()
        start, end = layer_range
        self.layers = nn.ModuleDict({
            str(i): ParallelTransformerLayer(config, parallel_state, init, i)
            for i in range(start, end)})
        self.recompute_plan = recompute_plan(config, end - start)
        self.inputs_replicated_over_tp = not config.sequence_parallel
        if post_process:
            self.final_layernorm = _layer_norm(config, torch_dtype(config.params_dtype),
                                               parallel_state)
        else:
            self.final_layernorm = None

    def forward(self, hidden: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                rotary: Optional[RotaryTables] = None,
                inference_cache: Optional[InferenceCache] = None) -> torch.Tensor:
        for chunk, recompute in self._chunks(inference_cache is None):
            run = _ChunkForward(chunk, attention_mask, rotary, inference_cache)
            if recompute:
                hidden = mpu_random.checkpoint(  # [b, s, h] ([b, s/tp, h] with SP)
                    run, hidden, inputs_replicated_over_tp=self.inputs_replicated_over_tp)
            else:
                hidden = run(hidden)  # [b, s, h] ([b, s/tp, h] with SP)
        if self.final_layernorm is not None:
            hidden = self.final_layernorm(hidden)
        return hidden

    def _chunks(self, may_recompute: bool) -> List[Tuple[List[nn.Module], bool]]:
        """This forward's layers as (consecutive layers, recompute them?) pairs."""
        layers: List[nn.Module] = list(self.layers.values())
        if not (may_recompute and self.recompute_plan.recomputed_layers and self.training
                and torch.is_grad_enabled()):
            return [(layers, False)]
        chunks, start = [], 0
        for count, recompute in self.recompute_plan.chunks:
            chunks.append((layers[start:start + count], recompute))
            start += count
        return chunks


class _ChunkForward:
    """Runs a chunk of layers with a fixed mask, RoPE tables and inference cache: what full
    recompute reruns (never with a cache)."""

    def __init__(self, layers: Sequence[nn.Module], attention_mask: Optional[torch.Tensor],
                 rotary: Optional[RotaryTables],
                 inference_cache: Optional[InferenceCache] = None) -> None:
        self.layers, self.attention_mask, self.rotary = layers, attention_mask, rotary
        self.inference_cache = inference_cache

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            hidden = layer(hidden, self.attention_mask, self.rotary, self.inference_cache)
        return hidden


class TransformerLanguageModel(nn.Module):
    """Embedding (first stage) + this stage's transformer layers (+ final LayerNorm, and with
    untied embeddings the column-parallel `output_layer`, on the last stage)."""

    def __init__(self, config: ModelConfig, parallel_state: ParallelState, init: ParamInit,
                 pre_process: bool, post_process: bool, layer_range: Tuple[int, int]) -> None:
        super().__init__()
        self.embedding = Embedding(config, parallel_state, init) if pre_process else None
        self.transformer = ParallelTransformer(config, parallel_state, init, layer_range,
                                               post_process)
        self.output_layer: Optional[ColumnParallelLinear] = None
        if post_process and config.untie_embeddings_and_output_weights:
            self.output_layer = ColumnParallelLinear(
                config.hidden_size, config.padded_vocab_size, bias=False,
                init_method=init.normal(OUTPUT_LAYER), parallel_state=parallel_state,
                params_dtype=torch_dtype(config.params_dtype),
                sequence_parallel=config.sequence_parallel)


class GPT2Model(nn.Module):
    """GPT-2 (Megatron-LM), or one pipeline stage of it when pre_process/post_process are False.

    forward(input_ids [b, s], position_ids [b, s], attention_mask=None, labels=None,
    inference_cache=None):
    - with `post_process` and `labels`: per-token loss [b, s] fp32 (no reduction, no loss mask);
    - with `post_process`, no labels: logits [b, s, V/tp] (this rank's vocab shard);
    - without `post_process`: hidden states [b, s, h] ([b, s/tp, h] with sequence parallelism)
      for the next stage.
    `parallel_state=None` means `app.mpu.parallel_state.get_parallel_state()` (the one-process
    state unless `initialize_model_parallel` ran). Stages without `pre_process` take their input
    from `set_input_tensor`; every stage gets `input_ids` or `position_ids` (RoPE and ALiBi need
    the positions on every stage). Unless `untie_embeddings_and_output_weights`, the last stage
    holds the tied output embedding: the first stage's word embeddings, or, when it has no
    embedding, its own `word_embeddings.weight` initialised to the same values (flag
    `shared = True`; the pipeline keeps the two equal by all-reducing their gradients over the
    embedding group, see `shared_embedding_weight`).
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
        self.tied = not config.untie_embeddings_and_output_weights
        self.word_embeddings: Optional[VocabParallelEmbedding] = None
        if post_process and not pre_process and self.tied:
            self.word_embeddings = VocabParallelEmbedding(
                config.padded_vocab_size, config.hidden_size,
                init_method=init.normal(WORD_EMBEDDINGS), parallel_state=self.parallel_state,
                params_dtype=torch_dtype(config.params_dtype))
            self.word_embeddings.weight.shared = True
        self.rotary: Optional[RotaryEmbedding] = None
        if config.position_embedding_type == "rope":
            self.rotary = RotaryEmbedding(
                config.rotary_dim, config.rotary_base,
                config.rope_scaling_factor if config.use_rope_scaling else None,
                config.rotary_seq_len_interpolation_factor)
        slopes = None
        if config.position_embedding_type == "alibi":  # this rank's heads' slopes
            tp = self.parallel_state.tensor_model_parallel_size
            rank = self.parallel_state.tensor_model_parallel_rank
            per_rank = config.num_attention_heads // tp
            slopes = torch.tensor(
                alibi_slopes(config.num_attention_heads)[rank * per_rank:(rank + 1) * per_rank])
        self.register_buffer("alibi_slopes", slopes, persistent=False)
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
        """The word embedding [V/tp, h] of this stage: the lookup table on stage 0, the tied
        output embedding on a last stage without it."""
        if self.pre_process:
            return self.language_model.embedding.word_embeddings.weight
        if self.word_embeddings is None:
            raise RuntimeError("word_embeddings_weight() called on a stage without embeddings")
        return self.word_embeddings.weight

    def shared_embedding_weight(self) -> Optional[torch.Tensor]:
        """The word-embedding weight whose gradient is summed over the embedding group (the
        first and last pipeline stage's), or None where there is none: a stage (or model chunk)
        without the embedding or the output layer, a single stage, and every stage with untied
        embeddings and output weights."""
        if not self.tied or self.parallel_state.pipeline_model_parallel_size == 1:
            return None
        if self.pre_process or self.post_process:
            return self.word_embeddings_weight()
        return None

    def forward(self, input_ids: Optional[torch.Tensor],
                position_ids: Optional[torch.Tensor] = None,
                attention_mask: Optional[torch.Tensor] = None,
                labels: Optional[torch.Tensor] = None,
                inference_cache: Optional[InferenceCache] = None) -> torch.Tensor:
        if position_ids is None and input_ids is not None:
            seq = torch.arange(input_ids.shape[1], device=input_ids.device)
            position_ids = seq.unsqueeze(0)  # [1, s], broadcast over the batch
        if self.pre_process:
            hidden = self.language_model.embedding(input_ids, position_ids)  # [b, s, h]
        else:
            if self.input_tensor is None:
                raise RuntimeError(
                    "this pipeline stage has no embedding: call set_input_tensor() first")
            hidden = self.input_tensor
        rotary = self.rotary(position_ids) if self.rotary is not None else None
        if self.alibi_slopes is not None:  # the mask folded into one additive bias
            s_q = position_ids.shape[-1]
            cached = inference_cache.offset if inference_cache is not None else 0
            attention_mask = alibi_bias(self.alibi_slopes, s_q, cached + s_q, attention_mask,
                                        hidden.dtype)  # [b or 1, nh/tp, s_q, s_k]
        hidden = self.language_model.transformer(hidden, attention_mask, rotary,
                                                 inference_cache)  # [b, s, h]
        if not self.post_process:
            return hidden
        logits = self._logits(hidden)  # [b, s, V/tp]
        if labels is None:
            return logits.float()  # callers get fp32 logits whatever the weights' dtype
        return lm_loss(logits, labels, self.parallel_state,
                       in_fp32=not self.config.fp16_lm_cross_entropy,
                       fusion=self.config.cross_entropy_loss_fusion)  # [b, s] fp32

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[b, s, h] (or [b, s/tp, h], gathered along s) -> this rank's logits [b, s, V/tp]."""
        output_layer = self.language_model.output_layer
        if output_layer is not None:
            return output_layer(hidden)
        return column_parallel_linear(hidden, self.word_embeddings_weight(), None,
                                      self.parallel_state, self.config.sequence_parallel)


def compile_transformer_layers(model: nn.Module) -> int:
    """Compile each transformer layer of `model` (a stage, or every chunk of one) in place with
    torch.compile, as torchtitan compiles per block; returns how many layers were compiled.

    `nn.Module.compile` keeps the parameter names (checkpoints do not change) and the layers
    identical in code share one compiled graph. Inside a layer the fused ops take their
    PyTorch paths, which the compiler fuses (app.model.fused); what lies outside the layers
    (embedding, final LayerNorm, LM head and loss) keeps its eager ops and csrc/ kernels.
    The tensor-parallel collectives are traced into the graph; full recompute wraps whole
    layers from outside; saving and restoring RNG states inside a layer (attention dropout's
    model-parallel stream, selective recompute) splits its graph there.
    """
    layers = [m for m in model.modules() if isinstance(m, ParallelTransformerLayer)]
    for layer in layers:
        layer.compile()
    return len(layers)


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
