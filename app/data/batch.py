"""Turn a batch of samples into model inputs: tokens, labels, loss mask, attention mask, positions.

Megatron's semantics for the three flags, where a "segment" is a run of tokens that ends with an
EOD token (the EOD belongs to the segment it closes):
- reset_position_ids: positions restart at 0 after every EOD;
- reset_attention_mask: a token attends only to earlier tokens of its own segment;
- eod_mask_loss: no loss where the input token is EOD (the prediction across a document boundary).
"""
from __future__ import annotations

from typing import Dict, Optional

import torch


def get_ltor_masks_and_position_ids(tokens: torch.Tensor, eod: int, reset_position_ids: bool,
                                    reset_attention_mask: bool, eod_mask_loss: bool):
    """(attention_mask bool [b,1,s,s] True = masked, or None = plain causal; loss_mask float [b,s];
    position_ids int64 [b,s]) for left-to-right LM inputs `tokens` [b, s]."""
    b, s = tokens.shape
    device = tokens.device
    is_eod = tokens == eod  # [b, s]
    loss_mask = torch.ones(b, s, dtype=torch.float32, device=device)
    if eod_mask_loss:
        loss_mask[is_eod] = 0.0
    arange = torch.arange(s, device=device)
    # segment_start[b, j]: index of the first token of j's segment = 1 + last EOD before j
    after_eod = torch.zeros(b, s, dtype=torch.long, device=device)
    after_eod[:, 1:] = torch.where(is_eod[:, :-1], arange[1:].expand(b, -1),
                                   torch.zeros((), dtype=torch.long, device=device))
    segment_start = torch.cummax(after_eod, dim=1).values  # [b, s]
    if reset_position_ids:
        position_ids = arange.unsqueeze(0) - segment_start
    else:
        position_ids = arange.unsqueeze(0).expand(b, s).clone()
    attention_mask: Optional[torch.Tensor] = None
    if reset_attention_mask:
        causal = arange.view(1, s, 1) >= arange.view(1, 1, s)  # [1, s(query), s(key)]
        same_segment = arange.view(1, 1, s) >= segment_start.unsqueeze(2)  # key after q's start
        attention_mask = ~(causal & same_segment)  # [b, s, s], True = masked out
        attention_mask = attention_mask.unsqueeze(1)  # [b, 1, s, s]
    return attention_mask, loss_mask, position_ids


def get_batch(text: torch.Tensor, eod: int, reset_position_ids: bool = False,
              reset_attention_mask: bool = False, eod_mask_loss: bool = False
              ) -> Dict[str, Optional[torch.Tensor]]:
    """Model inputs from samples `text` int64 [b, s+1]: tokens = text[:, :-1], labels = text[:, 1:].

    Returns dict(tokens [b,s], labels [b,s], loss_mask float32 [b,s], attention_mask bool
    [b,1,s,s] with True = masked out (None when reset_attention_mask is off: plain causal),
    position_ids int64 [b,s]).
    """
    if text.dim() != 2 or text.size(1) < 2:
        raise ValueError(f"text must be [batch, seq_length + 1] with seq_length >= 1, "
                         f"got shape {tuple(text.shape)}")
    text = text.long()
    tokens = text[:, :-1].contiguous()  # [b, s]
    labels = text[:, 1:].contiguous()  # [b, s]
    attention_mask, loss_mask, position_ids = get_ltor_masks_and_position_ids(
        tokens, eod, reset_position_ids, reset_attention_mask, eod_mask_loss)
    return {"tokens": tokens, "labels": labels, "loss_mask": loss_mask,
            "attention_mask": attention_mask, "position_ids": position_ids}
