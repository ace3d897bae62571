"""Per-layer key/value cache for incremental decoding, sharded like the attention heads.

Each layer of this pipeline stage gets two buffers [b, nh/tp, max_length, hd], allocated at its
first step with the dtype and device of its keys. A forward of s new tokens writes them at
[offset, offset + s) and attends to [0, offset + s); `advance(s)` then moves the offset, once
per step for all layers. Decoding one token thus costs a fixed amount of work per layer besides
the attention over the cached keys, instead of a forward over the whole sequence.
"""
from __future__ import annotations

from typing import Dict, Tuple

import torch


class KVCache:
    """Keys/values of every layer of one stage for a batch of `batch_size` rows, up to
    `max_length` tokens; implements app.model.gpt2.InferenceCache."""

    def __init__(self, batch_size: int, max_length: int) -> None:
        self.batch_size, self.max_length = batch_size, max_length
        self.offset = 0
        self._keys: Dict[int, torch.Tensor] = {}
        self._values: Dict[int, torch.Tensor] = {}

    def append(self, layer_number: int, key: torch.Tensor, value: torch.Tensor
               ) -> Tuple[torch.Tensor, torch.Tensor]:
        """Store key/value [b, nh/tp, s, hd] at the current offset; return [b, nh/tp, offset+s, hd]."""
        b, heads, s, head_dim = key.shape
        end = self.offset + s
        if end > self.max_length:
            raise ValueError(f"KV cache holds {self.max_length} tokens; a step would reach {end}")
        if b != self.batch_size:
            raise ValueError(f"KV cache was built for batch {self.batch_size}, got {b}")
        if layer_number not in self._keys:
            shape = (b, heads, self.max_length, head_dim)
            self._keys[layer_number] = torch.empty(shape, dtype=key.dtype, device=key.device)
            self._values[layer_number] = torch.empty(shape, dtype=value.dtype, device=value.device)
        keys, values = self._keys[layer_number], self._values[layer_number]
        keys[:, :, self.offset:end] = key
        values[:, :, self.offset:end] = value
        return keys[:, :, :end], values[:, :, :end]

    def advance(self, steps: int) -> None:
        """Mark `steps` more tokens as cached (call after every layer of the stage has run)."""
        self.offset += steps

    def reorder(self, rows: torch.Tensor) -> None:
        """Keep batch rows `rows` [b] (beam search: each new beam continues an old one)."""
        for store in (self._keys, self._values):
            for layer, buffer in store.items():
                store[layer] = buffer.index_select(0, rows.to(buffer.device))
