"""Log-likelihood of continuations, the way lm-evaluation-harness's `hf` backend computes it, on a
PipelineRunner at any TP/PP.

One row is (context token ids, continuation token ids). The model reads
`(context + continuation)[-(max_length + 1):][:-1]` (left-truncated to the model's positions),
right-padded to the longest row of the batch; the log-softmax over the tokenizer's vocabulary at
the last len(continuation) positions gives the continuation's log-probability (their sum) and
whether greedy decoding would have produced it (every target is the argmax).
"""
from __future__ import annotations

from typing import List, Sequence, Tuple

import torch

from app.inference.runner import PipelineRunner

Row = Tuple[Sequence[int], Sequence[int]]


def model_inputs(rows: Sequence[Row], max_length: int) -> List[List[int]]:
    """The tokens the model reads for each row (the last one is never read: it is only a target);
    ValueError when a row has no context or no continuation, or a continuation longer than
    `max_length`."""
    inputs = []
    for number, (context, continuation) in enumerate(rows):
        if not context or not continuation:
            raise ValueError(f"row {number}: a scored row needs at least one context token and "
                             "one continuation token")
        if len(continuation) > max_length:
            raise ValueError(f"row {number}: a continuation of {len(continuation)} tokens does not "
                             f"fit the model's {max_length} positions")
        inputs.append(list(context + continuation)[-(max_length + 1):][:-1])
    return inputs


@torch.no_grad()
def continuation_logprobs(runner: PipelineRunner, rows: Sequence[Row], vocab_size: int,
                          max_length: int, pad_id: int) -> List[Tuple[float, bool]]:
    """(sum of log p of the continuation's tokens, all of them greedy) for each row, one forward
    over the batch; the same on every rank."""
    rows = [(list(c), list(t)) for c, t in rows]
    inputs = model_inputs(rows, max_length)
    width = max(len(i) for i in inputs)
    device = runner.device
    tokens = torch.full((len(rows), width), pad_id, dtype=torch.long, device=device)  # [b, s]
    for i, row in enumerate(inputs):
        tokens[i, :len(row)] = torch.tensor(row, device=device)
    positions = torch.arange(width, device=device).unsqueeze(0).expand(len(rows), -1)  # [b, s]
    logits = runner.forward(tokens, positions)  # [b, s, V_padded] on the last stage, else None
    out = torch.zeros(len(rows), 2, dtype=torch.float64, device=device)  # [b, (logprob, greedy)]
    if logits is not None:
        logprobs = torch.log_softmax(logits[..., :vocab_size].float(), dim=-1)  # [b, s, V]
        for i, (_, continuation) in enumerate(rows):
            end = len(inputs[i])
            scored = logprobs[i, end - len(continuation):end]  # [c, V]
            targets = torch.tensor(continuation, device=device)  # [c]
            out[i, 0] = scored.gather(1, targets.unsqueeze(1)).sum().double()
            out[i, 1] = float(bool((scored.argmax(dim=-1) == targets).all()))
    runner.broadcast_from_last_stage(out)
    return [(float(lp), bool(greedy)) for lp, greedy in out.tolist()]
