"""A GPT-2 stage ready for inference on this rank: loaded from a checkpoint, run through the
pipeline stages without gradients, with full-vocabulary logits on the last stage.

Every rank of a TP x PP world (data-parallel size 1) holds the same token tensors; a forward
step runs stage 0's embedding and layers, sends the hidden states [b, s, h] stage to stage, and
gathers the vocab-parallel logits over the tensor-parallel group on the last stage. Decisions
made there (the next tokens, beam choices) reach every rank through `broadcast_from_last_stage`.
"""
from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass
from typing import Dict, Optional

import torch

from app.checkpoint import CheckpointError, formats
from app.checkpoint import param_layout as layout
from app.checkpoint.legacy import per_rank as legacy
from app.checkpoint.mcore.state import check_checkpoint_version
from app.checkpoint.model_args import model_config_from_args
from app.checkpoint.param_layout import target_padded_vocab
from app.checkpoint.saved_layout import SavedCheckpoint
from app.model.stage import build_model_stage, parameter_records
from app.mpu import collectives
from app.mpu.parallel_state import ParallelState
from app.pipeline import p2p

logger = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    """The model stage of this rank, the checkpoint's args and the tokenizer files it names."""

    model: torch.nn.Module
    args: argparse.Namespace
    vocab_size: int
    """Tokenizer vocabulary (logits beyond it are padding and never chosen)."""
    tokenizer_files: Dict[str, str]


def load_model(checkpoint: SavedCheckpoint, ps: ParallelState) -> LoadedModel:
    """This rank's stage of the model `checkpoint` (what app.checkpoint.formats.detect found in
    --load: Megatron legacy or torch_dist, DeepSpeed, or a Hugging Face directory), eval mode.

    When the layout of `ps` is a legacy Megatron checkpoint's, each rank reads only its own
    file; otherwise the whole checkpoint is read through its format's registry reader
    (app.checkpoint.formats; DeepSpeed: its fp32 master weights) and resharded in memory.
    """
    tp, pp = ps.tensor_model_parallel_size, ps.pipeline_model_parallel_size
    load, saved = checkpoint.load, checkpoint.tensor_pipeline_sizes
    if saved == (tp, pp) and checkpoint.expert_model_parallel_size == 1:
        return _load_own_file(checkpoint, ps)  # (expert-parallel files hold part of the experts)
    if saved is not None:
        logger.info("checkpoint %s was saved at TP %d x PP %d; resharding it in memory for "
                    "TP %d x PP %d", load, saved[0], saved[1], tp, pp)
    source = formats.read(checkpoint)
    args = source.args
    rows = target_padded_vocab(args, source.weights[layout.WORD_EMBEDDINGS].shape[0], tp)
    weights = layout.pad_vocabulary(source.weights, rows, getattr(args, "vocab_size", None))
    model = _build(args, rows, ps)
    placement = layout.Layout.of_args(args, pp, rows)
    try:  # each tensor split as the parallel layer that holds it marks it
        flat = {name: placement.shard(name, weights[name], ps)
                for name in parameter_records(model)}
    except KeyError as exc:
        raise CheckpointError(f"--load {load}: the checkpoint has no {exc.args[0]!r}, which "
                                   "the model its args describe holds") from exc
    model.load_state_dict(flat, strict=True)
    return LoadedModel(model.eval(), args, int(getattr(args, "vocab_size", None) or rows),
                       dict(source.tokenizer_files))


def _build(args: argparse.Namespace, rows: int, ps: ParallelState) -> torch.nn.Module:
    """This rank's stage of the model `args` describe, with `rows` vocabulary rows."""
    return build_model_stage(model_config_from_args(args, rows, for_inference=True), ps)


def _load_own_file(checkpoint: SavedCheckpoint, ps: ParallelState) -> LoadedModel:
    """This rank's own file of the legacy `checkpoint`, saved at this TP x PP."""
    state, iteration = legacy.load_checkpoint_dict(
        checkpoint.load, tp_rank=ps.tensor_model_parallel_rank,
        pp_rank=ps.pipeline_model_parallel_rank, pp_size=ps.pipeline_model_parallel_size,
        iteration=checkpoint.numbered_iteration(), tp_size=ps.tensor_model_parallel_size)
    where = checkpoint.folder
    check_checkpoint_version(state, where)
    args = state.get("args")
    if args is None:
        raise CheckpointError(f"{where} has no 'args': the model shape is unknown")
    model = _build(args, int(args.padded_vocab_size), ps)
    try:
        model.load_state_dict(legacy.from_megatron_model(state["model"]), strict=True)
    except RuntimeError as exc:
        raise CheckpointError(f"weights in {where} do not fit the model its args describe: "
                                   f"{str(exc).splitlines()[0][:300]}") from exc
    vocab = int(getattr(args, "vocab_size", None) or args.padded_vocab_size)
    return LoadedModel(model.eval(), args, vocab, {})


class PipelineRunner:
    """Forward steps of one model stage through the pipeline; logits on the last stage."""

    def __init__(self, model: torch.nn.Module, ps: ParallelState, hidden_size: int,
                 device: torch.device) -> None:
        self.model, self.ps, self.hidden_size, self.device = model, ps, hidden_size, device
        self.dtype = next(model.parameters()).dtype

    @property
    def is_last_stage(self) -> bool:
        return self.ps.is_pipeline_last_stage()

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor,
                attention_mask: Optional[torch.Tensor] = None, cache=None,
                labels: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
        """Run this stage on tokens [b, s]. Last stage: fp32 logits [b, s, V_padded] gathered
        over TP (or, with `labels`, the per-token loss [b, s]); other stages: None."""
        b, s = tokens.shape
        if not self.ps.is_pipeline_first_stage():
            hidden = p2p.recv_forward(self.ps, (b, s, self.hidden_size), self.dtype, self.device)
            self.model.set_input_tensor(hidden.detach())
        out = self.model(tokens, positions, attention_mask, labels=labels, inference_cache=cache)
        if not self.is_last_stage:
            p2p.send_forward(self.ps, out)
            return None
        if labels is not None:
            return out.float()
        return collectives.all_gather_last_dim(out, self.ps.tensor_model_parallel_group).float()

    def broadcast_from_last_stage(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` as the last stage's tensor-parallel rank 0 holds it, on every rank (in place;
        every rank passes a tensor of the same shape and dtype)."""
        if self.is_last_stage:
            collectives.broadcast(tensor, self.ps.tensor_model_parallel_src_rank,
                                  self.ps.tensor_model_parallel_group)
        collectives.broadcast(tensor, self.ps.pipeline_ranks[-1],
                              self.ps.pipeline_model_parallel_group)
        return tensor
