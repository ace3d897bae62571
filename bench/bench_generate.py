"""Decode cost per token with and without the KV cache, as the generated length grows.

The quickstart-size GPT-2 (4 layers, hidden 256, 4 heads, 256 positions, vocabulary 8192), one
process, fp32, greedy decoding of a batch of equal-length prompts. For each number of new
tokens N the table gives the prefill rate and the mean decode time per generated token: with
the cache it stays flat as N grows (each step feeds one token per row and attends to the cached
keys); recomputing the whole prefix every step costs more per token the longer the sequence.

    python bench/bench_generate.py                       # N = 16, 64, 128, 224; batch 4
    python bench/bench_generate.py --lengths 32,240 --batch 8 --repeats 3
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

# this checkout's `app`, whether or not the project is pip-installed
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from app.config import ModelConfig
from app.inference.generation import generate
from app.inference.runner import PipelineRunner
from app.inference.sampling import SamplingConfig
from app.model import GPT2Model
from app.mpu.parallel_state import ParallelState
from common import format_table, keep_freed_memory


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lengths", default="16,64,128,224", help="numbers of new tokens")
    p.add_argument("--prompt-length", type=int, default=16)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--repeats", type=int, default=2, help="best of this many runs per row")
    p.add_argument("--threads", type=int, default=None)
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    keep_freed_memory()
    vocab, positions = 8192, 256
    config = ModelConfig(num_layers=4, hidden_size=256, num_attention_heads=4, seq_length=positions,
                         max_position_embeddings=positions, padded_vocab_size=vocab,
                         hidden_dropout=0.0, attention_dropout=0.0, seed=1)
    model = GPT2Model(config).eval()
    runner = PipelineRunner(model, ParallelState.single(), 256, torch.device("cpu"))
    prompts = torch.randint(0, vocab - 1, (a.batch, a.prompt_length),
                            generator=torch.Generator().manual_seed(0)).tolist()
    eod = vocab - 1  # excluded from the choices below, so every row runs to the full length
    greedy = SamplingConfig(greedy=True)
    generate(runner, prompts, 8, greedy, eod, vocab - 1, positions)  # warm-up
    rows = []
    for new in (int(x) for x in a.lengths.split(",")):
        if a.prompt_length + new > positions:
            raise SystemExit(f"--prompt-length + {new} exceeds the model's {positions} positions")
        row = [new]
        for use_cache in (True, False):
            best = None
            for _ in range(a.repeats):
                result = generate(runner, prompts, new, greedy, eod, vocab - 1, positions,
                                  use_cache=use_cache)
                ms = 1e3 * result.decode_seconds / max(result.decode_tokens, 1)
                if best is None or ms < best[1]:
                    best = (result.prefill_tokens_per_s, ms, result.decode_tokens_per_s)
            row += [f"{best[1]:.2f}", f"{best[2]:.0f}"]
            if use_cache:
                row.insert(1, f"{best[0]:.0f}")
        rows.append(row)
    print(f"GPT-2 4 x 256, vocab {vocab}, batch {a.batch}, prompt {a.prompt_length} tokens, "
          f"{torch.get_num_threads()} threads, {time.strftime('%Y-%m-%d %H:%M')}")
    print(format_table(["new tokens", "prefill tok/s", "cache ms/token", "cache tok/s",
                        "recompute ms/token", "recompute tok/s"], rows))


if __name__ == "__main__":
    main()
