"""What the Hugging Face architectures we export can express of our model's options.

The checkpoint converter (tools/convert_checkpoint.py, app.checkpoint.convert) writes a model
as `GPT2LMHeadModel` when GPT-2's block expresses it, else as `LlamaForCausalLM` (or
`Qwen3ForCausalLM` with --qk-layernorm) when that does: `export_architecture` picks, and names
every option that neither can express. Options that change only how training runs (sequence
parallelism, recompute, dropout, fusions) do not block.
"""
from __future__ import annotations

from typing import List

from app.config import ModelConfig

GPT2, LLAMA, QWEN3 = "GPT2LMHeadModel", "LlamaForCausalLM", "Qwen3ForCausalLM"
"""The Hugging Face architectures (config.json "architectures") the converter writes."""


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
               "channels (such models export as LlamaForCausalLM)"
               for flag in config.llama_features])


def llama_export_blockers(config: ModelConfig) -> List[str]:
    """Reasons, one per option, why `config` cannot be written as a Hugging Face Llama model
    (with --qk-layernorm: Qwen3, Llama's block with an RMSNorm over each query and key head).

    Empty when it can. Each reason names the command-line option that set it (or that is
    missing)."""
    blockers = []
    if not config.swiglu:
        blockers.append("no --swiglu: Llama's MLP is gated (silu(gate) * up)")
    if config.normalization != "RMSNorm":
        blockers.append(f"--normalization {config.normalization}: Llama's norms are RMSNorm")
    if config.position_embedding_type != "rope":
        blockers.append(f"--position-embedding-type {config.position_embedding_type}: Llama "
                        "has rotary positions only (rope)")
    elif config.rotary_percent != 1.0:
        blockers.append(f"--rotary-percent {config.rotary_percent}: Llama rotates every channel "
                        "of a head")
    if config.qk_layernorm and config.add_bias_linear:
        blockers.append("--qk-layernorm without --disable-bias-linear: Qwen3 (Llama with "
                        "query/key norms) has no MLP biases")
    return blockers


def export_architecture(config: ModelConfig) -> str:
    """The Hugging Face architecture `config` exports as: GPT2, LLAMA or QWEN3 (a ValueError
    naming each option that neither GPT-2 nor Llama expresses when none fits)."""
    if not gpt2_export_blockers(config):
        return GPT2
    blockers = llama_export_blockers(config)
    if blockers:
        raise ValueError("the model is neither a Hugging Face GPT-2 (it uses "
                         + "; ".join(gpt2_export_blockers(config)) + ") nor a Llama model: "
                         + "; ".join(blockers))
    return QWEN3 if config.qk_layernorm else LLAMA
