"""Pretrain GPT-2 with a custom loss: label-smoothed cross-entropy plus a z-loss on the logits.

    python examples/custom_loss.py --label-smoothing 0.1 --z-loss 1e-4 <pretrain_gpt2.py flags>
    torchrun --nproc-per-node 2 examples/custom_loss.py --label-smoothing 0.1 \\
        --tensor-model-parallel-size 2 <pretrain_gpt2.py flags>

Every pretrain_gpt2.py flag works (parallel layouts, checkpoints, DeepSpeed); the two flags
above are this script's own. The loss is handed to `pretrain_gpt2.main(argv, loss_function=...)`
as an `app.training.loss.LossFunction` taking the full-vocabulary logits; its metrics appear in
the training log line (and in --metrics-file / TensorBoard) next to "lm loss":

    loss = (1 - eps) * CE + eps * mean_v(-log p_v) + z_weight * logsumexp(logits)^2

each term averaged over the tokens whose loss mask is 1 (PaLM's z-loss keeps the softmax
normaliser near 1). With eps = 0 and z_weight = 0 it is exactly Megatron's LM loss.
"""
from __future__ import annotations

import argparse
import sys
from typing import Dict, List, Optional, Tuple

import torch

import pretrain_gpt2
from app.training.loss import LossFunction


def smoothed_loss_with_z_loss(epsilon: float, z_weight: float) -> LossFunction:
    """The LossFunction above for label smoothing `epsilon` and z-loss weight `z_weight`."""
    if not 0.0 <= epsilon < 1.0:
        raise ValueError(f"--label-smoothing must be in [0, 1), got {epsilon}")
    if z_weight < 0.0:
        raise ValueError(f"--z-loss must be >= 0, got {z_weight}")

    def loss(logits: torch.Tensor, batch: Dict[str, torch.Tensor]
             ) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
        logits = logits.float()  # [b, s, V]
        log_z = torch.logsumexp(logits, dim=-1)  # [b, s]
        target = logits.gather(-1, batch["labels"].unsqueeze(-1)).squeeze(-1)  # [b, s]
        nll = log_z - target  # the plain cross-entropy
        uniform = log_z - logits.mean(dim=-1)  # mean over the vocabulary of -log p_v
        mask = batch["loss_mask"].float()
        mean = lambda t: (t * mask).sum() / mask.sum().clamp(min=1.0)  # noqa: E731
        total = (1.0 - epsilon) * mean(nll) + epsilon * mean(uniform) + z_weight * mean(log_z ** 2)
        return total, {"cross entropy": mean(nll).detach(), "z_loss": mean(log_z ** 2).detach()}

    return LossFunction(loss, inputs="logits")


def split_argv(argv: List[str]) -> Tuple[argparse.Namespace, List[str]]:
    """(this script's flags, the rest for pretrain_gpt2)."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--label-smoothing", type=float, default=0.1,
                        help="label-smoothing epsilon in [0, 1)")
    parser.add_argument("--z-loss", type=float, default=1e-4,
                        help="weight of logsumexp(logits)^2")
    return parser.parse_known_args(argv)


def main(argv: Optional[List[str]] = None) -> int:
    """Exit code of the run (0, or 2 for bad flags, data or checkpoints)."""
    own, rest = split_argv(list(sys.argv[1:] if argv is None else argv))
    try:
        loss_function = smoothed_loss_with_z_loss(own.label_smoothing, own.z_loss)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return pretrain_gpt2.main(rest, loss_function=loss_function)


if __name__ == "__main__":
    sys.exit(main())
