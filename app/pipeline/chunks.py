"""The model chunks one pipeline rank holds under the interleaved schedule, as one module.

With V virtual stages per rank, rank r holds V pieces of the model (chunk v has the layers of
virtual stage v x PP + r; see `partition.virtual_stage_layer_ranges`). `ModelChunks` keeps them
as one `nn.Module` so the engines, the optimizer and checkpoints see one model:

- the schedule picks the chunk to run with `set_chunk(v)`; `forward` and `set_input_tensor`
  then go to that chunk;
- `named_parameters()` and `state_dict()` are the union of the chunks' state dicts under their own (global) names, with
  no `chunks.<v>.` prefix, so a checkpoint names parameters exactly as a non-interleaved run
  does (the optimizer wrappers record these names too); `load_state_dict` hands each chunk its names back;
- `word_embeddings_weight()` is the tied embedding of the chunk that holds it (chunk 0 on the
  first stage, the last chunk on the last stage); `shared_embedding_weight()` the same, or None
  with untied embeddings.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.nn.modules.module import _IncompatibleKeys


class ModelChunks(nn.Module):
    """V model chunks of one pipeline rank, run one at a time; chunk 0 is the earliest."""

    def __init__(self, chunks: Sequence[nn.Module]) -> None:
        super().__init__()
        if not chunks:
            raise ValueError("ModelChunks needs at least one chunk")
        self.chunks = nn.ModuleList(chunks)
        self.current = 0

    @property
    def num_chunks(self) -> int:
        return len(self.chunks)

    def set_chunk(self, index: int) -> None:
        """Make chunk `index` the one `forward` and `set_input_tensor` act on."""
        if not 0 <= index < len(self.chunks):
            raise IndexError(f"chunk {index} out of range [0, {len(self.chunks)})")
        self.current = index

    def set_input_tensor(self, input_tensor: Any) -> None:
        self.chunks[self.current].set_input_tensor(input_tensor)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.chunks[self.current](*args, **kwargs)

    def word_embeddings_weight(self) -> torch.Tensor:
        """The tied word embeddings held by this rank (first or last pipeline stage)."""
        for chunk in self.chunks:
            if getattr(chunk, "pre_process", False) or getattr(chunk, "post_process", False):
                return chunk.word_embeddings_weight()
        raise RuntimeError("word_embeddings_weight() called on a rank whose chunks hold no "
                           "embedding (a middle pipeline stage)")

    def shared_embedding_weight(self) -> Optional[torch.Tensor]:
        """The chunks' word embedding summed over the embedding group, or None (untied
        embeddings, or no chunk holding the embedding or the output layer)."""
        for chunk in self.chunks:
            weight = chunk.shared_embedding_weight()
            if weight is not None:
                return weight
        return None

    # ---- parameters and state dicts under global names ----------------------------------------
    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[Tuple[str, nn.Parameter]]:
        """Every chunk's parameters under their own (global) names."""
        for chunk in self.chunks:
            yield from chunk.named_parameters(prefix=prefix, recurse=recurse,
                                              remove_duplicate=remove_duplicate)

    def state_dict(self, *args: Any, destination: Any = None, prefix: str = "",
                   keep_vars: bool = False) -> Dict[str, Any]:
        """Every chunk's entries under their own names (they do not overlap)."""
        if args:
            raise TypeError("ModelChunks.state_dict takes keyword arguments only")
        out = OrderedDict() if destination is None else destination
        for chunk in self.chunks:
            chunk.state_dict(destination=out, prefix=prefix, keep_vars=keep_vars)
        return out

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True,
                        assign: bool = False) -> _IncompatibleKeys:
        """Give each chunk the entries it names; missing and unexpected keys as torch reports."""
        owner: Dict[str, int] = {}
        for index, chunk in enumerate(self.chunks):
            owner.update({name: index for name in chunk.state_dict(keep_vars=True)})
        parts: List[Dict[str, Any]] = [OrderedDict() for _ in self.chunks]
        unexpected = [name for name in state_dict if name not in owner]
        for name, value in state_dict.items():
            if name in owner:
                parts[owner[name]][name] = value
        missing = [name for name in owner if name not in state_dict]
        if strict and (missing or unexpected):
            raise RuntimeError(f"Error(s) in loading state_dict for ModelChunks: missing keys "
                               f"{missing[:8]}, unexpected keys {unexpected[:8]}")
        for chunk, part in zip(self.chunks, parts):
            chunk.load_state_dict(part, strict=False, assign=assign)
        return _IncompatibleKeys(missing, unexpected)
