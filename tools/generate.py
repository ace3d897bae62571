"""Generate text from a GPT-2 checkpoint (ours at its saved TP/PP, or a Hugging Face directory).

    [torchrun --nproc_per_node TP*PP] tools/generate.py --load DIR --vocab-file F --merge-file F \
        [--tensor-model-parallel-size N --pipeline-model-parallel-size M] \
        (--prompt TEXT ... | --prompts-file F | interactive) --max-new-tokens N \
        [--greedy | --temperature T --top-k K --top-p P] [--num-beams B --length-penalty L] \
        [--seed S] [--output text|jsonl]

Decoding uses a KV cache (per layer, sharded like the heads, through the pipeline stages);
prompts of different lengths are batched with left padding. With --output jsonl, stdout gets
one JSON object per prompt ({prompt, generated_text, generated_tokens}); everything else,
including prefill and decode tokens/s, goes to stderr. See docs/inference.md.
"""
import argparse
import json
import os
import sys
from typing import List, Optional

# this checkout's `app`, whether or not the project is pip-installed
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def get_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--load", required=True, help="checkpoint directory or Hugging Face directory")
    p.add_argument("--vocab-file", help="GPT-2 vocab.json (default: the HF directory's)")
    p.add_argument("--merge-file", help="GPT-2 merges.txt (default: the HF directory's)")
    p.add_argument("--tensor-model-parallel-size", type=int, default=None)
    p.add_argument("--pipeline-model-parallel-size", type=int, default=None)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", nargs="+", action="extend", help="one or more prompts")
    src.add_argument("--prompts-file", help="one prompt per line ('-' for stdin)")
    p.add_argument("--max-new-tokens", type=int, required=True)
    p.add_argument("--greedy", action="store_true", help="argmax decoding (same as --top-k 1)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=0.0)
    p.add_argument("--top-p-decay", type=float, default=0.0, help="top_p *= decay after each token")
    p.add_argument("--top-p-bound", type=float, default=0.0, help="lower bound of the decayed top_p")
    p.add_argument("--num-beams", type=int, default=1)
    p.add_argument("--length-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--output", choices=["text", "jsonl"], default="text")
    p.add_argument("--no-kv-cache", action="store_true", help="recompute the prefix every step")
    return p.parse_args(argv)


def _params(a: argparse.Namespace):
    from app.inference.sampling import SamplingConfig
    from app.inference.session import GenerationParams
    greedy = a.greedy or (a.num_beams > 1) or (a.top_k == 0 and a.top_p == 0.0 and a.seed is None
                                               and a.temperature == 1.0)
    sampling = SamplingConfig(greedy=greedy, temperature=a.temperature, top_k=a.top_k,
                              top_p=a.top_p, top_p_decay=a.top_p_decay, top_p_bound=a.top_p_bound,
                              seed=a.seed)
    return GenerationParams(a.max_new_tokens, sampling, a.num_beams, a.length_penalty)


def _print(out: dict, fmt: str) -> None:
    for row in out["results"]:
        if fmt == "jsonl":
            print(json.dumps(row, ensure_ascii=False), flush=True)
        else:
            print(row["prompt"] + row["generated_text"], flush=True)
            print("-" * 40, flush=True)
    print(f"prefill {out['prefill_tokens_per_s']:.1f} tokens/s, decode "
          f"{out['decode_tokens_per_s']:.1f} tokens/s", file=sys.stderr, flush=True)


def _batches(a: argparse.Namespace):
    """Lists of prompts: all given ones at once, or one per interactive line."""
    if a.prompt:
        yield a.prompt
    elif a.prompts_file:
        stream = sys.stdin if a.prompts_file == "-" else open(a.prompts_file, encoding="utf-8")
        with stream:
            prompts = [line.rstrip("\n") for line in stream if line.strip()]
        if not prompts:
            raise ValueError(f"--prompts-file {a.prompts_file} holds no prompts")
        yield prompts
    else:
        while True:
            if sys.stdin.isatty():
                print("prompt> ", end="", file=sys.stderr, flush=True)
            line = sys.stdin.readline()
            if not line:
                return
            if line.strip():
                yield [line.rstrip("\n")]


def main(argv: Optional[List[str]] = None) -> int:
    from app.inference.session import configure_tool_logging, session_from_flags
    configure_tool_logging("generate")
    a = get_args(argv)
    from app.checkpoint.megatron import CheckpointError
    try:
        params = _params(a)
        session = session_from_flags(a, use_cache=not a.no_kv_cache)
    except (ValueError, CheckpointError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    status = 0
    if session.is_leader:
        try:
            for prompts in _batches(a):
                _print(session.generate(prompts, params), a.output)
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            status = 2
        finally:
            session.stop()
    else:
        session.follow()
    session.close()
    return status


if __name__ == "__main__":
    sys.exit(main())
