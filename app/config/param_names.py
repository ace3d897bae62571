"""Our parameter names (Megatron-LM's legacy flat names, global layer indices): the one table
that the model (app.model.gpt2) and the checkpoint formats (app.checkpoint) both import. No torch.

    language_model.embedding.word_embeddings.weight        [padded vocab, hidden]
    language_model.embedding.position_embeddings.weight    (learned absolute positions only)
    language_model.transformer.layers.{i}.{suffix}         layer i's parameters, global index
    language_model.transformer.final_layernorm.{weight,bias}
    language_model.output_layer.weight                     (untied embeddings only)
    word_embeddings.weight                                 the last stage's tied copy (PP > 1)
"""
from __future__ import annotations

import re
from typing import Optional, Tuple

WORD_EMBEDDINGS = "language_model.embedding.word_embeddings.weight"
POSITION_EMBEDDINGS = "language_model.embedding.position_embeddings.weight"
OUTPUT_LAYER = "language_model.output_layer.weight"
TIED_HEAD = "word_embeddings.weight"
"""The last stage's copy of the tied word embeddings (PP > 1; see app.model.gpt2.GPT2Model)."""
LAYER_PREFIX = "language_model.transformer.layers"
FINAL_NORM = ("language_model.transformer.final_layernorm.weight",
              "language_model.transformer.final_layernorm.bias")
_LAYER_NAME = re.compile(rf"^{re.escape(LAYER_PREFIX)}\.(\d+)\.(.+)$")


def layer_param_name(layer: int, suffix: str) -> str:
    """`language_model.transformer.layers.{layer}.{suffix}`: a layer's parameter by its global
    index."""
    return f"{LAYER_PREFIX}.{layer}.{suffix}"


def parse_layer(name: str) -> Optional[Tuple[int, str]]:
    """(global layer index, suffix) of a transformer-layer parameter; None for other names."""
    match = _LAYER_NAME.match(name)
    return (int(match.group(1)), match.group(2)) if match else None
