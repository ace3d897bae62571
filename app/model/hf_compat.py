"""What a Hugging Face GPT-2 (`GPT2LMHeadModel`) can express of our model's options.

The checkpoint converter (tools/convert_checkpoint.py, app.checkpoint.convert) writes and reads
the Hugging Face GPT-2 parameter layout only: before exporting to Hugging Face it asks
`gpt2_export_blockers` (app.checkpoint.hf_gpt2 passes it a checkpoint's saved `args` read
as a ModelConfig) and refuses with the returned reasons.
Options that change only how training runs (sequence parallelism, recompute, dropout, fusions)
do not block.
"""
from __future__ import annotations

from typing import List

from app.config import ModelConfig


def _blockers(position_embedding_type: str, heads: int, kv_heads: int,
              untied: bool) -> List[str]:
    blockers = []
    if position_embedding_type != "learned_absolute":
        blockers.append(
            f"--position-embedding-type {position_embedding_type}: GPT-2 has only a learned "
            "absolute position table (wpe) and no rotary or ALiBi attention")
    if kv_heads != heads:
        blockers.append(
            f"--group-query-attention --num-query-groups {kv_heads} (with {heads} attention "
            "heads): GPT-2's attention (c_attn) has one key and value head per query head")
    if untied:
        blockers.append("--untie-embeddings-and-output-weights: GPT-2's LM head is the word "
                        "embedding matrix (wte) transposed")
    return blockers


def gpt2_export_blockers(config: ModelConfig) -> List[str]:
    """Reasons, one per option, why `config` cannot be written as a Hugging Face GPT-2 model.

    Empty when it can. Each reason names the command-line option that set it.
    """
    return (_blockers(config.position_embedding_type, config.num_attention_heads,
                      config.num_kv_heads, config.untie_embeddings_and_output_weights)
            + [f"{flag}: GPT-2's block has LayerNorm, GeLU, biases and heads of hidden / heads "
               "channels (the Llama export and the converter for this block are not supported "
               "yet)" for flag in config.llama_features])

