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
import json
import os
import sys
from dataclasses import dataclass
from typing import ClassVar, List, Optional, Tuple

# this checkout's `app`, whether or not the project is pip-installed
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from app.config.cli import parse_config  # noqa: E402
from app.config.inference import InferenceLoadConfig  # noqa: E402
from app.config.options import PathOption, option  # noqa: E402


@dataclass(kw_only=True)
class GenerateOptions:
    """tools/generate.py's command line: the checkpoint, the prompts and the decoding."""

    FLAG_GROUP: ClassVar[Tuple[str, str]] = ("generation", "the prompts and the decoding")

    checkpoint: InferenceLoadConfig
    prompt: Optional[List[str]] = option("--prompt", default=None, nargs="+", action="extend",
                                         help="one or more prompts")
    prompts_file: Optional[str] = option("--prompts-file", default=None,
                                         path=PathOption("file", "a text file of prompts, one "
                                                         "a line, or '-' for stdin", stdin=True),
                                         help="one prompt per line ('-' for stdin)")
    max_new_tokens: int = option("--max-new-tokens", required=True)
    greedy: bool = option("--greedy", default=False,
                          help="argmax decoding (same as --top-k 1)")
    temperature: float = option("--temperature", default=1.0)
    top_k: int = option("--top-k", default=0)
    top_p: float = option("--top-p", default=0.0)
    top_p_decay: float = option("--top-p-decay", default=0.0,
                                help="top_p *= decay after each token")
    top_p_bound: float = option("--top-p-bound", default=0.0,
                                help="lower bound of the decayed top_p")
    num_beams: int = option("--num-beams", default=1)
    length_penalty: float = option("--length-penalty", default=1.0)
    seed: Optional[int] = option("--seed", default=None)
    output: str = option("--output", default="text", choices=("text", "jsonl"))
    no_kv_cache: bool = option("--no-kv-cache", default=False,
                               help="recompute the prefix every step")

    def __post_init__(self) -> None:
        if self.prompt and self.prompts_file is not None:
            raise ValueError(f"--prompt and --prompts-file {self.prompts_file} were both given; "
                             "pass one of them (or neither, for interactive prompts)")


def get_options(argv: Optional[List[str]] = None) -> GenerateOptions:
    """GenerateOptions from the command line (exit status 2 on a bad one)."""
    return parse_config(GenerateOptions, argv, __doc__.split("\n")[0])


def _params(a: GenerateOptions):
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


def _batches(a: GenerateOptions):
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
    from app.inference.session import configure_tool_logging, open_session
    configure_tool_logging("generate")
    a = get_options(argv)
    from app.checkpoint import CheckpointError
    try:
        params = _params(a)
        session = open_session(a.checkpoint, use_cache=not a.no_kv_cache)
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
