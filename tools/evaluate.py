"""Zero-shot evaluation of a GPT-2 checkpoint: WikiText-style perplexity or LAMBADA accuracy.

    [torchrun --nproc_per_node TP*PP] tools/evaluate.py --load DIR --task wikitext|lambada \
        --valid-data F --vocab-file F --merge-file F [--seq-length N] [--overlapping-eval N] \
        [--strict-lambada] [--micro-batch-size B] [--json-key text] [--no-detokenize] \
        [--results-file F] [--tensor-model-parallel-size N --pipeline-model-parallel-size M]

wikitext: --valid-data is a text file, or a loose-JSON file (one object per line, the
--json-key field is a document; documents are joined with the end-of-document token). lambada:
a loose-JSON file whose --json-key field holds each passage. The last stdout line is one JSON
object with the results (also written to --results-file). Nothing is downloaded. See
docs/inference.md.
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
class EvaluateOptions:
    """tools/evaluate.py's command line: the checkpoint, the task and its data."""

    FLAG_GROUP: ClassVar[Tuple[str, str]] = ("evaluation", "the task, its data and the windows")

    checkpoint: InferenceLoadConfig
    task: str = option("--task", required=True, choices=("wikitext", "lambada"))
    valid_data: str = option("--valid-data", required=True,
                             path=PathOption("file", "the evaluation file (text or loose JSON)"),
                             help="evaluation file (text or loose JSON)")
    seq_length: Optional[int] = option("--seq-length", default=None,
                                       help="window (default: the model's positions)")
    overlapping_eval: Optional[int] = option(
        "--overlapping-eval", default=None,
        help="sliding-window stride for wikitext (default: --seq-length, no overlap)")
    strict_lambada: bool = option("--strict-lambada", default=False,
                                  help="score the whole last word")
    micro_batch_size: int = option("--micro-batch-size", default=8)
    json_key: str = option("--json-key", default="text")
    no_detokenize: bool = option("--no-detokenize", default=False,
                                 help="wikitext: skip the WikiText detokenizer")
    results_file: Optional[str] = option("--results-file", default=None,
                                         help="also write the JSON results here")


def get_options(argv: Optional[List[str]] = None) -> EvaluateOptions:
    """EvaluateOptions from the command line (exit status 2 on a bad one)."""
    return parse_config(EvaluateOptions, argv, __doc__.split("\n")[0])


def _documents(path: str, key: str, loose_json: bool) -> List[str]:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--valid-data {path} does not exist")
    with open(path, encoding="utf-8") as f:
        if not loose_json:
            return [f.read()]
        docs = []
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                docs.append(json.loads(line)[key])
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"--valid-data {path} line {number}: not a JSON object with a "
                                 f"{key!r} string ({exc})") from exc
    if not docs:
        raise ValueError(f"--valid-data {path} holds no documents")
    return docs


def _wikitext(session, a: EvaluateOptions, seq_length: int) -> dict:
    from app.inference.zeroshot import PerplexityResult, count_words, perplexity, wikitext_detokenize
    loose = a.valid_data.endswith((".json", ".jsonl"))
    tokens: List[int] = []
    words = 0
    for doc in _documents(a.valid_data, a.json_key, loose):
        words += count_words(doc)
        text = doc if a.no_detokenize else wikitext_detokenize(doc)
        tokens += session.tokenizer.tokenize(text) + ([session.tokenizer.eod] if loose else [])
    if len(tokens) < 2:
        raise ValueError(f"--valid-data {a.valid_data} has fewer than 2 tokens")
    total, scored = perplexity(session.runner, tokens, seq_length, a.overlapping_eval,
                               session.tokenizer.eod, a.micro_batch_size)
    return PerplexityResult(total, scored, len(tokens), words).metrics()


def _lambada(session, a: EvaluateOptions, seq_length: int) -> dict:
    from app.inference.zeroshot import lambada_accuracy, lambada_example
    examples = []
    for number, text in enumerate(_documents(a.valid_data, a.json_key, True), start=1):
        context, target = lambada_example(session.tokenizer, text, a.strict_lambada)
        if not context or not target:
            raise ValueError(f"--valid-data {a.valid_data} example {number} has no context or no last word")
        if len(context) + len(target) - 1 > seq_length:
            raise ValueError(f"--valid-data {a.valid_data} example {number} is longer than "
                             f"--seq-length {seq_length}")
        examples.append((context, target))
    correct, total = lambada_accuracy(session.runner, examples, session.vocab_size,
                                      session.tokenizer.eod, a.micro_batch_size)
    return {"accuracy": correct / total, "correct": correct, "total": total,
            "strict": a.strict_lambada}


def main(argv: Optional[List[str]] = None) -> int:
    from app.inference.session import configure_tool_logging, open_session
    configure_tool_logging("evaluate")
    a = get_options(argv)
    from app.checkpoint import CheckpointError
    try:
        session = open_session(a.checkpoint)
        seq_length = a.seq_length or session.max_positions
        if not 0 < seq_length <= session.max_positions:
            raise ValueError(f"--seq-length {seq_length} must be in [1, {session.max_positions}]")
        results = (_wikitext if a.task == "wikitext" else _lambada)(session, a, seq_length)
    except (ValueError, CheckpointError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    results = {"task": a.task, "valid_data": a.valid_data, "load": a.checkpoint.load,
               "seq_length": seq_length, **results}
    if session.is_leader:
        if a.results_file:
            with open(a.results_file, "w", encoding="utf-8") as f:
                json.dump(results, f, indent=2)
        print(json.dumps(results), flush=True)
    session.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
