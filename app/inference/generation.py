"""Batched text generation over a PipelineRunner: greedy / sampled decoding and beam search,
with a KV cache (or, for checking, full recomputation) and left-padded prompts.

Prompts of different lengths are left-padded to the longest, P tokens; row i's real tokens get
positions 0.. and its padding is masked out of every attention. Every rank runs the same loop:
the last stage chooses the next tokens and broadcasts them, so all ranks stop together (at
`max_new_tokens`, or when every row has produced the end-of-document token).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence

import torch

from app.inference.kv_cache import KVCache
from app.inference.runner import PipelineRunner
from app.inference.sampling import SamplingConfig, choose_tokens


@dataclass
class GenerationResult:
    """New token ids per prompt (EOD included when produced) and timing of the two phases."""

    tokens: List[List[int]]
    prefill_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_tokens: int = 0
    decode_seconds: float = 0.0
    scores: List[float] = field(default_factory=list)
    """Beam search: the length-penalised log-probability of each returned sequence."""

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prefill_tokens / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds else 0.0


class _Batch:
    """Left-padded prompts [b, P] with room for `new` tokens: positions and padding masks."""

    def __init__(self, prompts: Sequence[Sequence[int]], new: int, pad_id: int,
                 max_positions: int, device: torch.device) -> None:
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        lengths = torch.tensor([len(p) for p in prompts], device=device)
        self.prompt_len = int(lengths.max())
        self.total = self.prompt_len + new
        if self.total > max_positions:
            raise ValueError(f"prompt of {self.prompt_len} tokens + {new} new tokens exceeds the "
                             f"model's {max_positions} positions")
        b = len(prompts)
        self.tokens = torch.full((b, self.total), pad_id, dtype=torch.long, device=device)
        for i, p in enumerate(prompts):
            self.tokens[i, self.prompt_len - len(p):self.prompt_len] = torch.tensor(p, device=device)
        start = (self.prompt_len - lengths).unsqueeze(1)  # [b, 1] first real column
        columns = torch.arange(self.total, device=device).unsqueeze(0)  # [1, total]
        self.pad = columns < start  # [b, total] True = padding
        self.positions = (columns - start).clamp(min=0)  # [b, total]
        self.padded = bool(self.pad.any())

    def mask(self, start: int, end: int) -> Optional[torch.Tensor]:
        """Attention mask [b, 1, end-start, end] (True = masked) for queries [start, end) over
        keys [0, end); None when plain causal attention is exact (no padding, no mixed step)."""
        if not self.padded and (start == 0 or end - start == 1):
            return None
        q = torch.arange(start, end, device=self.pad.device).unsqueeze(1)  # [s_q, 1]
        k = torch.arange(end, device=self.pad.device).unsqueeze(0)  # [1, s_k]
        future = (k > q).unsqueeze(0).unsqueeze(0)  # [1, 1, s_q, s_k]
        return future | self.pad[:, None, None, :end]  # [b, 1, s_q, s_k]


def _step(runner: PipelineRunner, batch: _Batch, start: int, end: int,
          cache: Optional[KVCache]) -> Optional[torch.Tensor]:
    """Logits [b, V_padded] of position end-1 (last stage), feeding tokens [start, end) with a
    cache, or the whole prefix [0, end) without one."""
    first = start if cache is not None else 0
    logits = runner.forward(batch.tokens[:, first:end], batch.positions[:, first:end],
                            batch.mask(first, end), cache)
    if cache is not None:
        cache.advance(end - first)
    return None if logits is None else logits[:, -1]


StopCheck = Callable[[List[List[int]]], List[bool]]
"""Given the new tokens of every row so far, whether each row is finished (e.g. its text holds a
stop sequence). Every rank calls it on the same tokens, so it must be deterministic."""


def generate(runner: PipelineRunner, prompts: Sequence[Sequence[int]], max_new_tokens: int,
             sampling: SamplingConfig, eod: int, vocab_size: int, max_positions: int,
             use_cache: bool = True, stop_check: Optional[StopCheck] = None) -> GenerationResult:
    """Greedy or sampled continuation of each prompt (token ids), up to `max_new_tokens` each.

    Rows stop at the EOD token, or when `stop_check` says so (the token that finished a row is
    kept); the loop stops when all rows have. With `sampling.seed` the draws are reproducible
    (one generator, seeded on every rank). `use_cache=False` recomputes the whole prefix at
    every step (the reference the cache must match).
    """
    device = runner.device
    batch = _Batch(prompts, max_new_tokens, eod, max_positions, device)
    b, start = len(prompts), batch.prompt_len
    cache = KVCache(b, batch.total) if use_cache else None
    generator = torch.Generator(device=device)
    if sampling.seed is not None:
        generator.manual_seed(sampling.seed)
    done = torch.zeros(b, dtype=torch.bool, device=device)
    lengths = torch.full((b,), max_new_tokens, dtype=torch.long, device=device)
    top_p = sampling.top_p
    result = GenerationResult(tokens=[])
    for step in range(max_new_tokens):
        t0 = time.perf_counter()
        cur = start + step
        logits = _step(runner, batch, cur - 1 if step and use_cache else 0, cur, cache)
        chosen = torch.empty(b, dtype=torch.long, device=device)
        if logits is not None:
            chosen = choose_tokens(logits[:, :vocab_size], sampling, top_p, generator)
            chosen = torch.where(done, torch.full_like(chosen, eod), chosen)
        runner.broadcast_from_last_stage(chosen)
        batch.tokens[:, cur] = chosen
        stopped = chosen == eod
        if stop_check is not None:
            stopped |= torch.tensor(stop_check(batch.tokens[:, start:cur + 1].tolist()),
                                    dtype=torch.bool, device=device)
        newly = stopped & ~done
        lengths[newly] = step + 1
        done |= stopped
        top_p = sampling.next_top_p(top_p)
        elapsed = time.perf_counter() - t0
        if step == 0:
            result.prefill_tokens, result.prefill_seconds = b * start, elapsed
        else:
            result.decode_tokens += b
            result.decode_seconds += elapsed
        if bool(done.all()):
            break
    new = batch.tokens[:, start:]
    result.tokens = [new[i, :int(lengths[i])].tolist() for i in range(b)]
    return result


def beam_search(runner: PipelineRunner, prompt: Sequence[int], max_new_tokens: int,
                num_beams: int, length_penalty: float, eod: int, vocab_size: int,
                max_positions: int) -> GenerationResult:
    """Beam search over one prompt (the rules of Hugging Face's beam search with
    early_stopping=False): 2 x num_beams candidates per step, a hypothesis ends at EOD or at the
    length limit and is scored sum(log p) / generated_length ** length_penalty; returns the best
    finished sequence."""
    device, nb = runner.device, num_beams
    batch = _Batch([prompt] * nb, max_new_tokens, eod, max_positions, device)
    prompt_len, keep = batch.prompt_len, 2 * nb
    cache = KVCache(nb, batch.total)
    running = torch.full((nb,), -1e9, device=device)
    running[0] = 0.0
    finished_scores = torch.full((nb,), -1e9, device=device)
    finished_tokens = torch.full((nb, max_new_tokens), eod, dtype=torch.long, device=device)
    finished_lengths = torch.zeros(nb, dtype=torch.long, device=device)
    improvable = True
    result = GenerationResult(tokens=[])
    t0 = time.perf_counter()
    for step in range(max_new_tokens):
        cur = prompt_len + step
        logits = _step(runner, batch, cur - 1 if step else 0, cur, cache)
        decision = torch.zeros(2, keep, dtype=torch.float64, device=device)  # scores, indices
        if logits is not None:
            logprobs = torch.log_softmax(logits[:, :vocab_size], dim=-1) + running[:, None]
            scores, flat = torch.topk(logprobs.reshape(-1), keep)
            decision[0], decision[1] = scores.double(), flat.double()
        runner.broadcast_from_last_stage(decision)
        scores, flat = decision[0].float(), decision[1].long()
        origin, token = flat // vocab_size, flat % vocab_size  # [keep]
        stops = (token == eod) | torch.tensor(cur + 1 >= batch.total, device=device)
        generated = step + 1
        # finished hypotheses: only stopping candidates among the best nb may enter
        candidate = scores / (generated ** length_penalty)
        eligible = stops & (torch.arange(keep, device=device) < nb) & improvable
        candidate = torch.where(eligible, candidate, torch.full_like(candidate, -1e9))
        merged = torch.cat([finished_scores, candidate])
        best = torch.topk(merged, nb).indices
        new_tokens = torch.cat([finished_tokens, _histories(batch, origin, prompt_len, token,
                                                            max_new_tokens, step)])
        new_lengths = torch.cat([finished_lengths, torch.full((keep,), generated, device=device)])
        finished_scores, finished_tokens = merged[best], new_tokens[best]
        finished_lengths = new_lengths[best]
        # running beams: the best nb candidates that did not stop
        alive = scores + stops.float() * -1e9
        chosen = torch.topk(alive, nb).indices
        running = alive[chosen]
        cache.reorder(origin[chosen])
        batch.tokens = batch.tokens[origin[chosen]]
        batch.tokens[:, cur] = token[chosen]
        best_possible = running[0] / max(generated, 1) ** length_penalty
        all_full = bool((finished_scores > -1e8).all())
        improvable = improvable and (not all_full or bool(best_possible > finished_scores.min()))
        if not improvable or bool(stops.all()):
            break
    result.decode_seconds = time.perf_counter() - t0
    result.decode_tokens = nb * (step + 1)
    length = int(finished_lengths[0])
    result.tokens = [finished_tokens[0, :length].tolist()]
    result.scores = [float(finished_scores[0])]
    return result


def _histories(batch: _Batch, origin: torch.Tensor, prompt_len: int, token: torch.Tensor,
               max_new: int, step: int) -> torch.Tensor:
    """Generated tokens [keep, max_new] of each candidate: its beam's history, then `token`,
    then the fill token (positions not generated yet hold it)."""
    out = batch.tokens[origin, prompt_len:prompt_len + max_new].clone()
    out[:, step] = token
    return out
