"""One inference world: the process group, this rank's model stage, the tokenizer, and a request
loop in which rank 0 leads and every other rank follows.

Rank 0 calls `generate(prompts, params)`, `generate_ids(prompt_ids, params)` or
`score(rows)`; the other ranks call `follow()`, which receives each request broadcast by rank 0,
runs the same computation, and returns when rank 0 calls `stop()`. So a command-line run, an
interactive prompt loop, the HTTP server and lm-evaluation-harness all drive every rank one
request at a time.
"""
from __future__ import annotations

import argparse
import logging
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

from app.checkpoint import formats
from app.checkpoint.saved_layout import SavedCheckpoint
from app.config.inference import InferenceLoadConfig
from app.data import build_tokenizer
from app.data.tokenizer import TOKENIZER_MODEL_TYPES, build_tokenizer_from
from app.inference.generation import GenerationResult, StopCheck, beam_search, generate
from app.inference.runner import PipelineRunner, load_model
from app.inference.sampling import SamplingConfig
from app.inference.scoring import continuation_logprobs
from app.launch.distributed import init_distributed, shutdown_distributed, world_group
from app.mpu import collectives
from app.mpu.parallel_state import ParallelState, initialize_model_parallel

logger = logging.getLogger(__name__)


@dataclass
class GenerationParams:
    """What one request asks for (validated on construction; messages name the field)."""

    max_new_tokens: int
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    num_beams: int = 1
    length_penalty: float = 1.0
    stop_sequences: List[str] = field(default_factory=list)
    """A row also stops once its generated text contains one of these (the text is not cut)."""

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.num_beams < 1:
            raise ValueError(f"num_beams must be >= 1, got {self.num_beams}")
        s = self.sampling
        if self.num_beams > 1 and (s.top_k > 1 or s.top_p > 0.0 or s.temperature != 1.0):
            raise ValueError("beam search does not sample: drop top_k/top_p/temperature or use "
                             "num_beams 1")
        if self.num_beams > 1 and self.stop_sequences:
            raise ValueError("stop_sequences need num_beams 1")


def resolve_layout(checkpoint: SavedCheckpoint, world_size: int, tp: Optional[int],
                   pp: Optional[int]):
    """(TP, PP) to run with: the flags, else the legacy `checkpoint`'s when the world matches
    it, else 1x1."""
    saved = checkpoint.tensor_pipeline_sizes
    if tp is None and pp is None:
        if saved and saved[0] * saved[1] == world_size:
            tp, pp = saved
        elif world_size == 1:
            tp, pp = 1, 1
        else:
            raise ValueError(f"{world_size} ranks but the checkpoint was saved at TP x PP = "
                             f"{saved[0] if saved else 1} x {saved[1] if saved else 1}; pass "
                             "--tensor-model-parallel-size and --pipeline-model-parallel-size")
    tp, pp = tp or 1, pp or 1
    if tp * pp != world_size:
        raise ValueError(f"--tensor-model-parallel-size {tp} x --pipeline-model-parallel-size {pp} "
                         f"must equal the number of ranks ({world_size}); inference runs with "
                         "data-parallel size 1 (torchrun --nproc_per_node TP*PP)")
    return tp, pp


def _session_tokenizer(args: Any, tokenizer_files: Dict[str, str], vocab_file: Optional[str],
                       merge_file: Optional[str], tokenizer_model: Optional[str]) -> Any:
    """The tokenizer to run a checkpoint with: --tokenizer-model when given (of the checkpoint's
    tokenizer type when that is a model-file type, else HuggingFaceTokenizer, or
    SentencePieceTokenizer for a `.model` file); else the one the checkpoint's args name; else
    GPT-2 BPE from --vocab-file/--merge-file or the Hugging Face directory's own files."""
    saved_type = getattr(args, "tokenizer_type", None)
    if tokenizer_model:
        if saved_type in TOKENIZER_MODEL_TYPES:
            kind = saved_type
        else:
            kind = ("SentencePieceTokenizer" if tokenizer_model.endswith(".model")
                    else "HuggingFaceTokenizer")
        return build_tokenizer_from(_saved_tokenizer(args, kind, tokenizer_model))
    if saved_type in TOKENIZER_MODEL_TYPES:
        return build_tokenizer_from(_saved_tokenizer(args, saved_type, args.tokenizer_model))
    vocab_file = vocab_file or tokenizer_files.get("vocab.json")
    merge_file = merge_file or tokenizer_files.get("merges.txt")
    if not (vocab_file and merge_file):
        raise ValueError("the checkpoint names no tokenizer: pass --vocab-file and --merge-file "
                         "(GPT-2 BPE) or --tokenizer-model (a tokenizer.json directory), the "
                         "tokenizer of the run that trained it")
    return build_tokenizer("GPT2BPETokenizer", vocab_file, merge_file)


def _saved_tokenizer(args: Any, kind: str, tokenizer_model: str) -> argparse.Namespace:
    """The tokenizer flags of `kind` over `tokenizer_model` with the rest (TikTokenizer's size
    and settings) as the checkpoint's args recorded them."""
    saved = vars(args) if args is not None else {}
    return argparse.Namespace(**{**saved, "tokenizer_type": kind, "vocab_file": None,
                                 "merge_file": None, "tokenizer_model": tokenizer_model})


class InferenceSession:
    """The model of `load` on this world (TP x PP ranks), its tokenizer, and the request loop."""

    def __init__(self, load: str, vocab_file: Optional[str] = None,
                 merge_file: Optional[str] = None, tensor_model_parallel_size: Optional[int] = None,
                 pipeline_model_parallel_size: Optional[int] = None,
                 use_cache: bool = True, tokenizer_model: Optional[str] = None) -> None:
        info = init_distributed()
        self.rank, self.device = info.rank, info.device
        checkpoint = formats.detect(load)  # once: the layout and the reader follow from it
        tp, pp = resolve_layout(checkpoint, info.world_size, tensor_model_parallel_size,
                                pipeline_model_parallel_size)
        self.ps = ParallelState.single() if info.world_size == 1 else initialize_model_parallel(tp, pp)
        self.world = world_group()
        loaded = load_model(checkpoint, self.ps)
        self.model = loaded.model.to(self.device)
        self.args, self.vocab_size = loaded.args, loaded.vocab_size
        self.tokenizer = _session_tokenizer(self.args, loaded.tokenizer_files, vocab_file,
                                            merge_file, tokenizer_model)
        if self.tokenizer.vocab_size != self.vocab_size:
            raise ValueError(f"the tokenizer has {self.tokenizer.vocab_size} tokens but the checkpoint "
                             f"was trained with {self.vocab_size}; pass the run's tokenizer "
                             "(--vocab-file/--merge-file, or --tokenizer-model)")
        self.max_positions = int(self.args.max_position_embeddings)
        self.runner = PipelineRunner(self.model, self.ps, int(self.args.hidden_size), self.device)
        self.use_cache = use_cache
        logger.info("loaded %s at TP %d x PP %d (%s parameters on rank %d)", load, tp, pp,
                    sum(p.numel() for p in self.model.parameters()), self.rank)

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def generate(self, prompts: List[str], params: GenerationParams) -> Dict[str, Any]:
        """(Rank 0) generate for every prompt on every rank; returns {'results': [{prompt,
        generated_text, generated_tokens}], 'prefill_tokens_per_s', 'decode_tokens_per_s'}."""
        return self._lead("generate", prompts, asdict(params))

    def generate_ids(self, prompts: List[List[int]], params: GenerationParams) -> GenerationResult:
        """(Rank 0) generate for prompts given as token ids (no beam search), on every rank."""
        return self._lead("generate_ids", prompts, asdict(params))

    def score(self, rows: Sequence[Tuple[List[int], List[int]]]) -> List[Tuple[float, bool]]:
        """(Rank 0) (log p, greedy) of each (context ids, continuation ids) row, one batch, on
        every rank (app.inference.scoring)."""
        return self._lead("score", [(list(c), list(t)) for c, t in rows])

    def follow(self) -> None:
        """(Ranks > 0) serve rank 0's requests until it calls stop()."""
        while True:
            op, *payload = collectives.broadcast_object(None, 0, self.world)
            if op == "stop":
                return
            try:
                self._dispatch(op, payload)
            except ValueError:  # every rank raises the same; rank 0 reports it
                continue

    def stop(self) -> None:
        """(Rank 0) release the following ranks."""
        collectives.broadcast_object(("stop",), 0, self.world)

    def _lead(self, op: str, *payload: Any) -> Any:
        collectives.broadcast_object((op, *payload), 0, self.world)
        return self._dispatch(op, list(payload))

    def _dispatch(self, op: str, payload: list) -> Any:
        if op == "score":
            return continuation_logprobs(self.runner, payload[0], self.vocab_size,
                                         self.max_positions, self.tokenizer.eod)
        prompts, raw = payload
        params = GenerationParams(**{**raw, "sampling": SamplingConfig(**raw["sampling"])})
        if op == "generate":
            return self._run(prompts, params)
        if op == "generate_ids":
            return self._generate_ids(prompts, params)
        raise ValueError(f"unknown inference request {op!r}")

    def _stop_check(self, stops: List[str]) -> Optional[StopCheck]:
        if not stops:
            return None
        detokenize = self.tokenizer.detokenize
        return lambda rows: [any(s in detokenize(r) for s in stops) for r in rows]

    def _generate_ids(self, ids: List[List[int]], params: GenerationParams) -> GenerationResult:
        return generate(self.runner, ids, params.max_new_tokens, params.sampling,
                        self.tokenizer.eod, self.vocab_size, self.max_positions,
                        use_cache=self.use_cache, stop_check=self._stop_check(params.stop_sequences))

    def _run(self, prompts: List[str], params: GenerationParams) -> Dict[str, Any]:
        ids = [self.tokenizer.tokenize(p) for p in prompts]
        eod = self.tokenizer.eod
        if params.num_beams > 1:
            results = [beam_search(self.runner, p, params.max_new_tokens, params.num_beams,
                                   params.length_penalty, eod, self.vocab_size, self.max_positions)
                       for p in ids]
            merged = GenerationResult(tokens=[r.tokens[0] for r in results],
                                      decode_tokens=sum(r.decode_tokens for r in results),
                                      decode_seconds=sum(r.decode_seconds for r in results))
        else:
            merged = self._generate_ids(ids, params)
        out = []
        for prompt, tokens in zip(prompts, merged.tokens):
            text_tokens = [t for t in tokens if t != eod]
            out.append({"prompt": prompt, "generated_text": self.tokenizer.detokenize(text_tokens),
                        "generated_tokens": tokens})
        return {"results": out, "prefill_tokens_per_s": merged.prefill_tokens_per_s,
                "decode_tokens_per_s": merged.decode_tokens_per_s}

    def close(self) -> None:
        shutdown_distributed(graceful=True)


def configure_tool_logging(tag: str) -> None:
    """stderr logging for an inference tool, prefixed `[tag]`: INFO on rank 0, warnings on the
    other ranks (stdout stays free for the tool's results)."""
    import os
    import sys
    level = logging.INFO if os.environ.get("RANK", "0") == "0" else logging.WARNING
    logging.basicConfig(level=level, format=f"[{tag}] %(message)s", stream=sys.stderr)


def open_session(checkpoint: InferenceLoadConfig, use_cache: bool = True) -> InferenceSession:
    """InferenceSession of the checkpoint a tool's --load, --vocab-file, --merge-file and
    --tensor/--pipeline-model-parallel-size name (or the lm_eval backend's --model_args)."""
    return InferenceSession(checkpoint.load, checkpoint.vocab_file, checkpoint.merge_file,
                            checkpoint.tensor_model_parallel_size,
                            checkpoint.pipeline_model_parallel_size, use_cache=use_cache,
                            tokenizer_model=checkpoint.tokenizer_model)


def prompt_too_long(session: InferenceSession, prompt: str, max_new_tokens: int) -> Optional[str]:
    """A message when the prompt plus the new tokens do not fit the model's positions, else None."""
    n = len(session.tokenizer.tokenize(prompt))
    if n == 0:
        return "empty prompt"
    if n + max_new_tokens > session.max_positions:
        return (f"prompt of {n} tokens + {max_new_tokens} new tokens exceeds the model's "
                f"{session.max_positions} positions")
    return None
