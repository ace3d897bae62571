"""The two closing steps of scripts/quickstart.sh: did the validation loss fall, and what does
the exported model write.

    python scripts/lib/quickstart_report.py loss RUN/metrics.jsonl --vocab-size 8192 [--no-check]
    python scripts/lib/quickstart_report.py sample RUN/hf [--prompt TEXT] [--seed 1]
        [--temperature 0.8] [--top-p 0.95] [--max-new-tokens 64]

`loss` prints the first and last validation loss against ln(vocab), the loss of a model that
knows nothing, and exits 1 unless the last is at least 2 nats below it (`--no-check`: print
only). `sample` loads the Hugging Face export with transformers and samples a continuation of
a code prompt with temperature and top-p, seeded: the same seed gives the same text.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from typing import List, Optional

MARGIN = 2.0
"""Nats below ln(vocab) that the last validation loss must reach."""


def loss_report(metrics_file: str, vocab_size: int, check: bool) -> int:
    """Print the validation losses of `metrics_file` against ln(vocab_size); 1 when `check`
    and the last is not MARGIN nats below it (or none was logged), else 0."""
    with open(metrics_file, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    valid = [row for row in rows if row.get("kind") == "valid"]
    start = math.log(vocab_size)
    if not valid:
        print(f"quickstart: no validation loss was logged in {metrics_file}", file=sys.stderr)
        return 1 if check else 0
    first, last = valid[0], valid[-1]
    print(f"validation loss: {first['lm_loss']:.3f} at iteration {first['iteration']} -> "
          f"{last['lm_loss']:.3f} at iteration {last['iteration']} (start: ln vocab = {start:.3f})")
    if check and last["lm_loss"] > start - MARGIN:
        print(f"quickstart: validation loss {last['lm_loss']:.3f} did not fall well below "
              f"ln(vocab) = {start:.3f}", file=sys.stderr)
        return 1
    return 0


def sample(hf_dir: str, prompt: str, seed: int, temperature: float, top_p: float,
           max_new_tokens: int) -> str:
    """`prompt` and a continuation sampled (temperature, top-p, seeded) by transformers from
    the Hugging Face GPT-2 in `hf_dir`, at most `max_new_tokens` and never past the model's
    positions."""
    import torch
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir)
    model = transformers.GPT2LMHeadModel.from_pretrained(hf_dir).eval()
    ids = tokenizer(prompt, return_tensors="pt").input_ids  # [1, prompt tokens]
    max_new_tokens = min(max_new_tokens, model.config.n_positions - ids.shape[1])
    transformers.set_seed(seed)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True,
                             temperature=temperature, top_p=top_p, top_k=0,
                             max_new_tokens=max_new_tokens,
                             pad_token_id=tokenizer.eos_token_id)  # [1, prompt + new tokens]
    return tokenizer.decode(out[0], skip_special_tokens=True)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    loss = sub.add_parser("loss", help="validation loss against ln(vocab)")
    loss.add_argument("metrics_file")
    loss.add_argument("--vocab-size", type=int, required=True)
    loss.add_argument("--no-check", action="store_true", help="print only; never fail")
    draw = sub.add_parser("sample", help="a seeded sample from the Hugging Face export")
    draw.add_argument("hf_dir")
    draw.add_argument("--prompt", default="def main(argv):\n    ")
    draw.add_argument("--seed", type=int, default=1)
    draw.add_argument("--temperature", type=float, default=0.8)
    draw.add_argument("--top-p", type=float, default=0.95)
    draw.add_argument("--max-new-tokens", type=int, default=64)
    a = p.parse_args(argv)
    if a.command == "loss":
        return loss_report(a.metrics_file, a.vocab_size, not a.no_check)
    text = sample(a.hf_dir, a.prompt, a.seed, a.temperature, a.top_p, a.max_new_tokens)
    print(f"sampled from the exported model by transformers (temperature {a.temperature}, "
          f"top-p {a.top_p}, seed {a.seed}; the same seed gives the same text):")
    print("    " + text.replace("\n", "\n    "))
    return 0


if __name__ == "__main__":
    sys.exit(main())
