"""The model card (README.md) of an exported Hugging Face directory: what the model is, what it
was trained on and for how long, how well it did, and how to load and sample it.

Everything comes from the checkpoint's Megatron args (shape, --data-path, the data position
consumed_train_samples x seq_length, the iteration) and, when given, the run's --metrics-file
JSONL (its last validation loss). Anything not known is written as "unknown", never guessed.
"""
from __future__ import annotations

import argparse
import json
import math
import os
from typing import List, Optional, Tuple

UNKNOWN = "unknown"


def final_validation_loss(metrics_file: str) -> Optional[Tuple[int, float]]:
    """(iteration, lm loss) of the last "valid" row of a --metrics-file JSONL; None if it has
    none. FileNotFoundError/ValueError naming the file when it is missing or not JSONL."""
    if not os.path.isfile(metrics_file):
        raise FileNotFoundError(f"--metrics-file {metrics_file} does not exist (the JSONL that "
                                "pretrain_gpt2.py --metrics-file wrote)")
    last = None
    with open(metrics_file, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as exc:
                raise ValueError(f"--metrics-file {metrics_file} line {number} is not JSON "
                                 f"({exc})") from exc
            if row.get("kind") == "valid" and isinstance(row.get("lm_loss"), (int, float)):
                last = (int(row["iteration"]), float(row["lm_loss"]))
    return last


def _tokens_seen(args: argparse.Namespace) -> str:
    samples = int(getattr(args, "consumed_train_samples", 0) or 0)
    seq = getattr(args, "seq_length", None)
    if samples <= 0 or not seq:
        return UNKNOWN
    return f"{samples * int(seq):,} ({samples:,} samples x {int(seq)} tokens)"


def _validation(metrics_file: Optional[str]) -> str:
    if not metrics_file:
        return f"{UNKNOWN} (pass the run's --metrics-file to tools/convert_checkpoint.py)"
    found = final_validation_loss(metrics_file)
    if found is None:
        return f"{UNKNOWN} ({metrics_file} has no validation rows)"
    iteration, loss = found
    return (f"{loss:.4f} (perplexity {math.exp(min(loss, 50.0)):.2f}) at iteration {iteration}, "
            f"from {os.path.basename(metrics_file)}")


def model_card(args: argparse.Namespace, iteration: object, num_parameters: int,
               model_path: str, metrics_file: Optional[str] = None,
               architecture: str = "GPT2LMHeadModel") -> str:
    """README.md text for the exported `architecture` (GPT2LMHeadModel, LlamaForCausalLM or
    Qwen3ForCausalLM) at `model_path` (the path shown in the examples)."""
    hidden, layers = int(args.hidden_size), int(args.num_layers)
    ffn = int(getattr(args, "ffn_hidden_size", 0) or 4 * hidden)
    gpt2 = architecture == "GPT2LMHeadModel"
    untied = bool(getattr(args, "untie_embeddings_and_output_weights", False))
    activation = ("gelu_new (tanh)" if getattr(args, "openai_gelu", False) else "gelu") if gpt2 \
        else "silu (SwiGLU: each gate and up half of the MLP size)"
    family = "GPT-2" if gpt2 else architecture.replace("ForCausalLM", "")
    data = getattr(args, "data_path", None)
    data_text = ", ".join(f"`{d}`" for d in data) if data else UNKNOWN
    rows: List[Tuple[str, str]] = [
        ("layers", str(layers)), ("hidden size", str(hidden)),
        ("attention heads", str(args.num_attention_heads)), ("MLP size", str(ffn)),
        ("context (positions)", str(args.max_position_embeddings)),
        ("vocabulary", str(getattr(args, "vocab_size", None) or args.padded_vocab_size)),
        ("activation", activation),
        ("parameters", f"{num_parameters:,} (output layer "
                       f"{'separate from' if untied else 'tied to'} the word embeddings)")]
    trained = [("training data (--data-path)", data_text), ("tokens seen", _tokens_seen(args)),
               ("iterations", str(getattr(args, "iteration", None) or iteration or UNKNOWN)),
               ("global batch size", str(getattr(args, "global_batch_size", None) or UNKNOWN)),
               ("final validation loss", _validation(metrics_file))]
    new = max(1, min(32, int(args.max_position_embeddings) // 2))  # fits the context
    table = lambda items: "\n".join(f"| {k} | {v} |" for k, v in items)  # noqa: E731
    return f"""---
library_name: transformers
pipeline_tag: text-generation
tags: [{family.lower().replace("-", "")}, megatron]
---
# {family}, {layers} layers x {hidden} hidden

A {family} language model (`{architecture}`) trained with this project's Megatron-LM style trainer
and exported by `tools/convert_checkpoint.py --output-format hf`.

## Architecture

| | |
| --- | --- |
{table(rows)}

## Training

| | |
| --- | --- |
{table(trained)}

## Use

```python
from transformers import pipeline

generator = pipeline("text-generation", model="{model_path}")
print(generator("def main(", max_new_tokens={new}, do_sample=True, top_p=0.9)[0]["generated_text"])
```

```python
from transformers import AutoModelForCausalLM, AutoTokenizer

tokenizer = AutoTokenizer.from_pretrained("{model_path}")
model = AutoModelForCausalLM.from_pretrained("{model_path}")
ids = tokenizer("def main(", return_tensors="pt").input_ids
print(tokenizer.decode(model.generate(ids, max_new_tokens={new})[0]))
```
"""
