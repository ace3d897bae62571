"""EleutherAI's lm-evaluation-harness (`lm_eval`) on our checkpoints: the model type `megatron_gpt2`.

    python -m app.inference.lm_eval_backend --model megatron_gpt2 \
        --model_args load=DIR,vocab_file=F,merge_file=F[,tensor_model_parallel_size=N] \
        --tasks lambada_openai,hellaswag [--batch_size 8] [any other lm_eval flag]
    torchrun --nproc_per_node TP*PP -m app.inference.lm_eval_backend --model megatron_gpt2 \
        --model_args load=DIR,vocab_file=F,merge_file=F --tasks ...

`load` is a Megatron checkpoint (any TP/PP; under torchrun each rank reads its own file when
the world is the saved layout), a DeepSpeed checkpoint of ours or a Hugging Face GPT-2 directory,
exactly as for tools/generate.py. lm_eval 0.4 finds model types only in its own registry (no
plugin entry point), so importing this module registers ours and `main()` then runs lm_eval's
command line unchanged (`gpt2-lm-eval` is the same, installed as a console script).

Model-parallel ranks: global rank 0 runs the harness and every other rank follows it
(app.inference.session), so all requests are computed once by the whole TP x PP group. Without a
launcher, `tensor_model_parallel_size=N` (and/or `pipeline_model_parallel_size=M`) in
--model_args spawns the N x M - 1 other ranks on this host. The three request types are computed
the way lm_eval's `hf` backend does (same tokenization, truncation, rolling windows, stop
sequences; greedy unless the task asks for sampling), batched (`--batch_size`, sorted by
length) and with our KV cache for generation.
"""
from __future__ import annotations

import atexit
import json
import logging
import multiprocessing
import os
import sys
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

try:
    from lm_eval.api.model import TemplateLM
    from lm_eval.api.registry import model_registry, register_model
    from lm_eval.models.utils import (handle_stop_sequences, normalize_gen_kwargs,
                                      postprocess_generated_text)
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("the lm-evaluation-harness backend needs lm_eval: pip install lm-eval "
                      "(it is in requirements.txt)") from exc

from app.config.inference import InferenceLoadConfig
from app.config.options import from_flags, iter_options
from app.data.tokenizer import EOD_TOKEN
from app.checkpoint.formats import detect_format
from app.inference.sampling import SamplingConfig
from app.inference.session import GenerationParams, InferenceSession, open_session
from app.launch.ports import free_port

logger = logging.getLogger(__name__)

MODEL_NAME = "megatron_gpt2"
_SAMPLING_KEYS = ("do_sample", "temperature", "top_k", "top_p")
_OWN_MODEL_ARGS = ("max_gen_toks", "seed", "use_cache")
"""MegatronGPT2LM's --model_args besides the checkpoint's (InferenceLoadConfig)."""
Row = Tuple[List[int], List[int]]


def checkpoint_of(model_args: Dict[str, Any]) -> InferenceLoadConfig:
    """The checkpoint that --model_args name: its keys are the dests of InferenceLoadConfig's
    flags (load, vocab_file, merge_file, tensor_model_parallel_size,
    pipeline_model_parallel_size), each value cast to the flag's type; ValueError naming a key
    that is none of these (nor one of MegatronGPT2LM's own), a value of the wrong type, or a
    missing load."""
    options = {opt.flag.dest: opt for opt in iter_options(InferenceLoadConfig)}
    unknown = sorted(set(model_args) - set(options))
    if unknown:
        raise ValueError(f"--model_args {', '.join(unknown)} not understood by {MODEL_NAME}; it "
                         f"takes {', '.join([*options, *_OWN_MODEL_ARGS])}")
    if model_args.get("load") is None:
        raise ValueError(f"--model_args load=DIR is required by {MODEL_NAME} (a checkpoint or "
                         "Hugging Face directory)")
    values = {}
    for key, value in model_args.items():
        kind = options[key].scalar_type
        try:
            values[key] = None if value is None else kind(value)
        except (TypeError, ValueError):
            raise ValueError(f"--model_args {key}={value!r}: expected {kind.__name__}") from None
    return from_flags(InferenceLoadConfig, values)


def _batch_size(value: Any) -> int:
    """lm_eval's --batch_size (a string or int) as a positive int; 'auto' is refused."""
    try:
        size = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"--batch_size {value!r}: {MODEL_NAME} needs a number (no 'auto')") from None
    if size < 1:
        raise ValueError(f"--batch_size must be >= 1, got {size}")
    return size


class MegatronGPT2LM(TemplateLM):
    """lm_eval model: log-likelihoods, rolling log-likelihoods and generations of our GPT-2.

    --model_args: the checkpoint's (`checkpoint_of`: load (required), vocab_file, merge_file
    (default: the files beside an HF directory), tensor_model_parallel_size,
    pipeline_model_parallel_size, as the tools' flags), max_gen_toks (default 256), seed
    (sampling tasks, default 1234), use_cache (KV cache, default true).
    """

    def __init__(self, batch_size: Any = 1, max_gen_toks: int = 256, seed: int = 1234,
                 use_cache: bool = True, max_batch_size: Any = None, device: Any = None,
                 **model_args: Any) -> None:
        super().__init__()
        checkpoint = checkpoint_of(model_args)
        if device not in (None, "cpu") and not str(device).startswith("cuda"):
            raise ValueError(f"--device {device}: {MODEL_NAME} runs on cuda:LOCAL_RANK or the CPU")
        self.batch_size = _batch_size(batch_size)
        self._max_gen_toks, self._seed = int(max_gen_toks), int(seed)
        kwargs = dict(checkpoint=checkpoint, use_cache=bool(use_cache))
        ranks = ((checkpoint.tensor_model_parallel_size or 1)
                 * (checkpoint.pipeline_model_parallel_size or 1))
        self._spawned: Optional[SpawnedWorld] = None
        if ranks > 1 and int(os.environ.get("WORLD_SIZE", "1")) == 1:  # no launcher made ranks
            detect_format(checkpoint.load)  # a wrong path fails here, before any spawn
            self._spawned = SpawnedWorld(ranks, kwargs)
        try:
            self.session: Optional[InferenceSession] = open_session(**kwargs)
        except BaseException:
            if self._spawned is not None:
                self._spawned.close(timeout=0)
            raise
        if not self.session.is_leader:  # torchrun: this rank only computes what rank 0 asks
            self.session.follow()
            self.session.close()
            sys.exit(0)
        self._eos_text = self.session.tokenizer.detokenize([self.session.tokenizer.eod])
        atexit.register(self.close)

    def close(self) -> None:
        """Release the following ranks and the process group (idempotent; also at exit)."""
        session, self.session = self.session, None
        if session is None:
            return
        session.stop()
        session.close()
        if self._spawned is not None:
            self._spawned.close()

    # ------------------------------------------------------------------ what lm_eval reads

    @property
    def eot_token_id(self) -> int:
        return self.session.tokenizer.eod

    @property
    def max_length(self) -> int:
        return self.session.max_positions

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def tokenizer_name(self) -> str:
        tokenizer = self.session.tokenizer
        return getattr(tokenizer, "vocab_file", None) or tokenizer.tokenizer_model

    def tok_encode(self, string: str, add_special_tokens: Optional[bool] = None,
                   left_truncate_len: Optional[int] = None, **kwargs: Any) -> List[int]:
        """The tokenizer's ids of `string` (no special tokens added: a Hugging Face tokenizer's
        BOS neither; a literal <|endoftext|> is the EOD id, as Hugging Face's GPT-2 tokenizer
        reads it), keeping the last `left_truncate_len`."""
        tokenizer = self.session.tokenizer
        encode = getattr(tokenizer, "tokenize_plain", tokenizer.tokenize)
        ids: List[int] = []
        for number, piece in enumerate(string.split(EOD_TOKEN)):
            if number:
                ids.append(tokenizer.eod)
            ids += encode(piece) if piece else []
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def tok_decode(self, tokens: Sequence[int]) -> str:
        return self.session.tokenizer.detokenize(tokens)

    # ------------------------------------------------------------------ the three request types

    def _loglikelihood_tokens(self, requests: List[Tuple[Any, List[int], List[int]]],
                              disable_tqdm: bool = False, **kwargs: Any) -> List[Tuple[float, bool]]:
        """(log p, greedy) of each (strings, context ids, continuation ids) request."""
        results = self._score([(list(c), list(t)) for _, c, t in requests])
        for (strings, _, _), answer in zip(requests, results):
            if strings is not None:
                self.cache_hook.add_partial("loglikelihood", strings, answer)
        return results

    def loglikelihood_rolling(self, requests: List[Any], disable_tqdm: bool = False) -> List[float]:
        """Log-likelihood of each whole string: disjoint windows of the model's length, each
        token predicted once, the first from the EOD token (lm_eval's rolling windows)."""
        rows: List[Row] = []
        owner: List[int] = []
        for number, request in enumerate(requests):
            windows = get_rolling_token_windows(token_list=self.tok_encode(request.args[0]),
                                                prefix_token=self.prefix_token_id,
                                                max_seq_len=self.max_length, context_len=1)
            for context, continuation in map(make_disjoint_window, windows):
                rows.append((context, continuation))
                owner.append(number)
        totals = [0.0] * len(requests)
        for number, (logprob, _) in zip(owner, self._score(rows)):
            totals[number] += logprob
        for request, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    def generate_until(self, requests: List[Any], disable_tqdm: bool = False) -> List[str]:
        """Each context's continuation, up to its `until` stop sequences (cut there) or
        max_gen_toks; requests with the same generation kwargs are batched."""
        groups: Dict[str, List[int]] = {}
        for number, request in enumerate(requests):
            key = json.dumps(request.args[1], sort_keys=True, default=str)
            groups.setdefault(key, []).append(number)
        results: List[str] = [""] * len(requests)
        for numbers in groups.values():
            contexts = [requests[n].args[0] for n in numbers]
            texts = self._generate(contexts, requests[numbers[0]].args[1])
            for number, text in zip(numbers, texts):
                results[number] = text
                self.cache_hook.add_partial("generate_until", requests[number].args, text)
        return results

    # ------------------------------------------------------------------ helpers

    def _score(self, rows: List[Row]) -> List[Tuple[float, bool]]:
        """Rows scored in batches of --batch_size, longest first; results in the given order."""
        order = sorted(range(len(rows)), key=lambda i: (-len(rows[i][0]) - len(rows[i][1]),
                                                        tuple(rows[i][0] + rows[i][1])))
        results: List[Tuple[float, bool]] = [(0.0, False)] * len(rows)
        for chunk in _chunks(order, self.batch_size):
            for number, answer in zip(chunk, self.session.score([rows[i] for i in chunk])):
                results[number] = answer
        return results

    def _generate(self, contexts: List[str], gen_kwargs: Dict[str, Any]) -> List[str]:
        kwargs = dict(normalize_gen_kwargs(gen_kwargs, self.max_gen_toks))
        until = handle_stop_sequences(kwargs.pop("until", None), eos=self._eos_text)
        max_gen_toks = int(kwargs.pop("max_gen_toks"))
        kwargs.pop("max_length", None)
        context_room = self.max_length - max_gen_toks
        if context_room <= 0:
            raise ValueError(f"max_gen_toks ({max_gen_toks}) must be below the model's "
                             f"{self.max_length} positions")
        params = GenerationParams(max_gen_toks, self._sampling(kwargs), stop_sequences=until)
        encoded = [self.tok_encode(c, left_truncate_len=context_room) for c in contexts]
        order = sorted(range(len(contexts)), key=lambda i: (-len(encoded[i]), contexts[i]))
        texts: List[str] = [""] * len(contexts)
        eod = self.eot_token_id
        for chunk in _chunks(order, self.batch_size):
            prompts = [encoded[i] if encoded[i] else [eod] for i in chunk]
            out = self.session.generate_ids(prompts, params)
            for number, tokens in zip(chunk, out.tokens):
                text = self.tok_decode([t for t in tokens if t != eod])
                texts[number] = postprocess_generated_text(text, until, None)
        return texts

    def _sampling(self, kwargs: Dict[str, Any]) -> SamplingConfig:
        """Greedy, or the task's temperature/top_k/top_p sampling (seeded); other keys refused."""
        extra = sorted(k for k in kwargs if k not in _SAMPLING_KEYS)
        if extra:
            raise ValueError(f"generation kwargs {extra} are not supported by {MODEL_NAME} "
                             f"(it reads until, max_gen_toks, {', '.join(_SAMPLING_KEYS)})")
        temperature = float(kwargs.get("temperature") or 0.0)
        if not kwargs.get("do_sample") or temperature == 0.0:
            return SamplingConfig(greedy=True)
        top_p = float(kwargs.get("top_p") or 0.0)
        return SamplingConfig(temperature=temperature, top_k=int(kwargs.get("top_k") or 0),
                              top_p=0.0 if top_p >= 1.0 else top_p, seed=self._seed)


def register() -> None:
    """Register MegatronGPT2LM as lm_eval's `megatron_gpt2` (once per process: run as
    `python -m`, this file is both __main__ and, for spawned ranks, imported again)."""
    if MODEL_NAME not in model_registry:
        register_model(MODEL_NAME)(MegatronGPT2LM)


register()


def _chunks(items: Sequence[int], size: int) -> Iterator[List[int]]:
    for start in range(0, len(items), size):
        yield list(items[start:start + size])


class SpawnedWorld:
    """Ranks 1..world_size-1 started on this host (each builds the same InferenceSession and
    follows rank 0), with this process made rank 0 of that world (127.0.0.1, a free port) until
    `close()` restores its environment."""

    _VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK")

    def __init__(self, world_size: int, session_kwargs: Dict[str, Any]) -> None:
        world = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port("127.0.0.1")),
                 "WORLD_SIZE": str(world_size)}
        self._saved = {k: os.environ.get(k) for k in self._VARIABLES}
        context = multiprocessing.get_context("spawn")
        self.processes = []
        for rank in range(1, world_size):
            process = context.Process(target=_follow, args=(rank, world, session_kwargs),
                                      name=f"{MODEL_NAME} rank {rank}", daemon=True)
            process.start()
            self.processes.append(process)
        os.environ.update(world, RANK="0", LOCAL_RANK="0")

    def close(self, timeout: float = 60.0) -> None:
        """Wait for the followers to leave (terminate those that do not); restore the env."""
        for process in self.processes:
            process.join(timeout=timeout)
            if process.is_alive():
                process.terminate()
        for key, value in self._saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _follow(rank: int, world: Dict[str, str], session_kwargs: Dict[str, Any]) -> None:
    os.environ.update(world, RANK=str(rank), LOCAL_RANK=str(rank))
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format=f"[{MODEL_NAME} rank {rank}] %(message)s")
    session = open_session(**session_kwargs)
    session.follow()
    session.close()


OFFLINE_HINT = (
    "lm_eval's own tasks (lambada_openai, hellaswag, wikitext, ...) download their datasets from "
    "the Hugging Face Hub on first use. Run once where the Hub is reachable (the data is then "
    "cached under ~/.cache/huggingface/datasets, or $HF_DATASETS_CACHE, and later runs with "
    "HF_DATASETS_OFFLINE=1 read the cache), copy that cache to this machine, or evaluate a "
    "local task: a YAML over a local JSON/JSONL file, with --include_path DIR "
    "(docs/inference.md, \"Offline evaluation\")")
"""What to do when a task's dataset cannot be reached."""


def _unreachable_errors() -> Tuple[type, ...]:
    """The exceptions that say a dataset could not be fetched: `datasets` raises the builtin
    ConnectionError (offline too); httpx, which it downloads with, its own when a transfer breaks."""
    try:
        import httpx
    except ImportError:  # pragma: no cover - httpx comes with datasets
        return (ConnectionError,)
    return (ConnectionError, httpx.ConnectError, httpx.TimeoutException)


def main(argv: Optional[List[str]] = None) -> None:
    """lm_eval's command line with `megatron_gpt2` registered (same flags as `lm_eval`); exit
    status 2 with OFFLINE_HINT when a task's dataset cannot be reached."""
    from lm_eval.__main__ import cli_evaluate
    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    try:
        cli_evaluate()
    except _unreachable_errors() as exc:
        print(f"error: a task's dataset could not be fetched: {exc}.\n{OFFLINE_HINT}",
              file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
