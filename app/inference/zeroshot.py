"""Zero-shot evaluation the way Megatron-LM's GPT-2 tasks do it: WikiText-style perplexity with
sliding windows, and LAMBADA last-word accuracy. Runs on a PipelineRunner at any TP/PP.

Perplexity: the text is tokenized once; window i covers tokens [i*stride, i*stride + seq + 1)
(stride = --overlapping-eval, default seq) and, after the first window, scores only its last
`stride` targets, so every target after the first token is scored exactly once with up to `seq`
tokens of context. Reported: the mean loss per token, ppl = exp(loss), and the word-level
ppl = exp(loss * (tokens - 1) / (words - 1)) (Megatron's "adjusted ppl"), words counted by
splitting the original text on spaces before the WikiText detokenizer is applied.

LAMBADA: each example's last word must be produced greedily, every one of its tokens being the
argmax given the text before it. --strict-lambada takes the last whitespace-separated word;
otherwise the last token.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch

from app.inference.runner import PipelineRunner
from app.utils.progress import progress


def wikitext_detokenize(text: str) -> str:
    """Undo WikiText's tokenization (' @-@ ' -> '-', ' , ' -> ', ', '( x )' -> '(x)', ...)."""
    text = text.replace("s '", "s'")
    text = re.sub(r"/' [0-9]/", r"/'[0-9]/", text)
    for sep in ("-", ",", "."):
        text = text.replace(f" @{sep}@ ", sep)
    for mark in (":", ";", ".", "!", "?", ","):
        text = text.replace(f" {mark} ", f"{mark} ")
    for open_, close in (("(", ")"), ("[", "]"), ("{", "}")):
        pattern = re.escape(open_) + r"\s*([^" + re.escape(close) + r"]*?)\s*" + re.escape(close)
        text = re.sub(pattern, lambda m, o=open_, c=close: f"{o}{m.group(1)}{c}", text)
    text = re.sub(r'"\s*([^"]*?)\s*"', r'"\1"', text)
    text = re.sub(r"'\s*([^']*?)\s*'", r"'\1'", text)
    for n in (4, 3, 2):
        text = text.replace(" ".join(["="] * n), "=" * n)
    text = text.replace(" " + chr(176) + " ", chr(176))
    text = text.replace(" \n", "\n").replace("\n ", "\n")
    text = text.replace(" N ", " 1 ").replace(" 's", "'s")
    return text


def count_words(text: str) -> int:
    """Megatron's count of original tokens: pieces of the stripped text split on single spaces."""
    return len(text.strip().split(" "))


@dataclass
class PerplexityResult:
    """Summed loss over the scored tokens and the counts the metrics come from."""

    total_loss: float
    scored_tokens: int
    num_tokenized_tokens: int
    num_original_tokens: int

    def metrics(self) -> dict:
        loss = self.total_loss / max(self.scored_tokens, 1)
        ratio = (self.num_tokenized_tokens - 1) / max(self.num_original_tokens - 1, 1)
        return {"loss": loss, "ppl": math.exp(min(20.0, loss)),
                "adjusted_ppl": math.exp(min(20.0, loss * ratio)), "token_ratio": ratio,
                "scored_tokens": self.scored_tokens,
                "num_tokenized_tokens": self.num_tokenized_tokens,
                "num_original_tokens": self.num_original_tokens}


def sliding_windows(tokens: Sequence[int], seq_length: int, stride: Optional[int], pad_id: int
                    ) -> List[Tuple[List[int], List[int]]]:
    """(tokens [seq+1], loss mask [seq]) of every window; each target after the first token is
    scored exactly once."""
    stride = max(1, min(stride or seq_length, seq_length))
    targets = len(tokens) - 1
    count = max(math.ceil(max(targets - stride, 0) / stride) + 1, 1)
    windows = []
    for i in range(count):
        piece = list(tokens[i * stride:i * stride + seq_length + 1])
        mask = [1] * (len(piece) - 1) + [0] * (seq_length + 1 - len(piece))
        piece += [pad_id] * (seq_length + 1 - len(piece))
        if i > 0 and stride != seq_length:
            mask = [0] * (seq_length - stride) + mask[seq_length - stride:]
        windows.append((piece, mask))
    return windows


def _batches(items: list, size: int, runner: PipelineRunner, desc: str):
    """`items` in batches of `size`, with progress (rate, ETA) on global rank 0's stderr."""
    starts = range(0, len(items), size)
    for start in progress(starts, desc=desc, unit=" batches", disable=runner.ps.rank != 0):
        yield items[start:start + size]


def perplexity(runner: PipelineRunner, tokens: Sequence[int], seq_length: int,
               stride: Optional[int], pad_id: int, micro_batch_size: int = 8) -> Tuple[float, int]:
    """(summed loss, scored tokens) of `tokens` with sliding windows; the same on every rank."""
    total = torch.zeros(2, dtype=torch.float64, device=runner.device)
    positions = torch.arange(seq_length, device=runner.device).unsqueeze(0)
    windows = sliding_windows(tokens, seq_length, stride, pad_id)
    for batch in _batches(windows, micro_batch_size, runner, "perplexity"):
        text = torch.tensor([w for w, _ in batch], device=runner.device)  # [b, s+1]
        mask = torch.tensor([m for _, m in batch], dtype=torch.float64, device=runner.device)
        losses = runner.forward(text[:, :-1], positions.expand(len(batch), -1),
                                labels=text[:, 1:])  # [b, s] on the last stage
        if losses is not None:
            total[0] += (losses.double() * mask).sum()
            total[1] += mask.sum()
    runner.broadcast_from_last_stage(total)
    return float(total[0]), int(total[1])


def lambada_example(tokenizer, text: str, strict: bool) -> Tuple[List[int], List[int]]:
    """(context tokens, target tokens): the last word (strict) or the last token."""
    if not strict:
        ids = tokenizer.tokenize(text)
        return ids[:-1], ids[-1:]
    last = text.split()[-1]
    start = text.rfind(last)
    return tokenizer.tokenize(text[:start].strip()), tokenizer.tokenize(" " + last)


def lambada_accuracy(runner: PipelineRunner, examples: Sequence[Tuple[List[int], List[int]]],
                     vocab_size: int, pad_id: int, micro_batch_size: int = 8) -> Tuple[int, int]:
    """(correct, total): an example is correct when greedy decoding reproduces all its targets."""
    correct = torch.zeros(1, dtype=torch.float64, device=runner.device)
    for batch in _batches(list(examples), micro_batch_size, runner, "lambada"):
        length = max(len(c) + len(t) for c, t in batch) - 1
        rows = [(c + t)[:-1] + [pad_id] * (length - len(c) - len(t) + 1) for c, t in batch]
        tokens = torch.tensor(rows, device=runner.device)  # [b, length], right-padded
        positions = torch.arange(length, device=runner.device).unsqueeze(0).expand(len(batch), -1)
        logits = runner.forward(tokens, positions)  # [b, length, V_padded] on the last stage
        if logits is None:
            continue
        predicted = logits[..., :vocab_size].argmax(dim=-1)
        for i, (context, target) in enumerate(batch):
            first = len(context) - 1  # the position whose prediction is target[0]
            got = predicted[i, first:first + len(target)].tolist()
            correct[0] += float(got == list(target))
    runner.broadcast_from_last_stage(correct)
    return int(correct[0]), len(examples)
