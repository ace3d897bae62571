"""What a Hugging Face GPT-2 (`GPT2LMHeadModel`) can express of our model's options.

The GPT-2 export (tools/convert_checkpoint.py) calls `gpt2_export_blockers(model_config)`
before writing anything and refuses with the returned reasons. Options that change only how
training runs (sequence parallelism, recompute, dropout, fusions) do not block an export.
"""
from __future__ import annotations

from typing import List

from app.config import ModelConfig


def gpt2_export_blockers(config: ModelConfig) -> List[str]:
    """Reasons, one per option, why `config` cannot be written as a Hugging Face GPT-2 model.

    Empty when it can. Each reason names the command-line option that set it.
    """
    blockers = []
    kind = config.position_embedding_type
    if kind != "learned_absolute":
        blockers.append(
            f"--position-embedding-type {kind}: GPT-2 has only a learned absolute position "
            "table (wpe) and no rotary or ALiBi attention")
    if config.num_kv_heads != config.num_attention_heads:
        blockers.append(
            f"--group-query-attention --num-query-groups {config.num_kv_heads} (with "
            f"{config.num_attention_heads} attention heads): GPT-2's attention (c_attn) has one "
            "key and value head per query head")
    if config.untie_embeddings_and_output_weights:
        blockers.append(
            "--untie-embeddings-and-output-weights: GPT-2's LM head is the word embedding "
            "matrix (wte) transposed")
    return blockers
