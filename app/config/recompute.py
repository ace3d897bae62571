"""Activation recompute: what a model chunk recomputes (`recompute_plan`) and Megatron's two
spellings of the recompute flags (`resolve_recompute_flags`). Pure; part of `app.config`."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Tuple


@dataclass(frozen=True)
class RecomputePlan:
    """What one model chunk's forward (its consecutive layers) recomputes in backward."""

    granularity: str
    """none, selective (every layer's attention core) or full (the chunks marked below)."""
    chunks: Tuple[Tuple[int, bool], ...]
    """The chunk's layers in order, as (consecutive layers, run through one checkpoint?)."""

    @property
    def recomputed_layers(self) -> int:
        """Layers whose whole forward runs twice (full recompute)."""
        return sum(n for n, recomputed in self.chunks if recomputed)

    @property
    def largest_recomputed_chunk(self) -> int:
        """Layers rerun at once in backward (their activations live together); 0 without."""
        return max((n for n, recomputed in self.chunks if recomputed), default=0)

    @property
    def checkpointed_regions(self) -> int:
        """Checkpoint calls in one forward: one attention core per layer (selective), one per
        recomputed chunk (full), 0 without recompute."""
        if self.granularity == "selective":
            return sum(n for n, _ in self.chunks)
        return sum(1 for _, recomputed in self.chunks if recomputed)


def recompute_plan(config: Any, layers: int) -> RecomputePlan:
    """The recompute of a model chunk of `layers` consecutive layers (a pipeline stage, or one
    virtual stage with interleaving), as Megatron-LM does it: full uniform checkpoints chunks
    of recompute_num_layers layers (the last may be shorter); full block checkpoints the first
    recompute_num_layers layers one by one and keeps the others; selective recomputes every
    layer's attention core and checkpoints no whole layer."""
    if config.recompute_granularity != "full":
        return RecomputePlan(config.recompute, ((layers, False),) if layers else ())
    n = config.recompute_num_layers
    if config.recompute_method == "uniform":
        chunks = tuple((min(n, layers - i), True) for i in range(0, layers, n))
    else:
        block = min(n, layers)
        chunks = ((1, True),) * block + (((layers - block, False),) if layers > block else ())
    return RecomputePlan("full", chunks)


def resolve_recompute_flags(checkpoint_activations: bool, checkpoint_num_layers: Optional[int],
                            granularity: Optional[str], method: Optional[str],
                            num_layers: Optional[int]
                            ) -> Tuple[Optional[str], Optional[str], Optional[int]]:
    """(granularity, method, num_layers) from Megatron's two spellings of activation recompute.

    `--checkpoint-activations [--checkpoint-num-layers N]` (the older spelling) means
    `--recompute-granularity full --recompute-method uniform --recompute-num-layers N`; mixing
    the spellings is accepted only where they agree. `--checkpoint-num-layers` alone does
    nothing, as in Megatron-LM.
    """
    if not checkpoint_activations:
        return granularity, method, num_layers
    for flag, value, legacy in (("--recompute-granularity", granularity, "full"),
                                ("--recompute-method", method, "uniform"),
                                ("--recompute-num-layers", num_layers, checkpoint_num_layers)):
        if value is not None and legacy is not None and value != legacy:
            raise ValueError(
                f"--checkpoint-activations means --recompute-granularity full "
                f"--recompute-method uniform --recompute-num-layers <--checkpoint-num-layers>, "
                f"which contradicts {flag} {value}; use one spelling")
    return "full", "uniform", num_layers or checkpoint_num_layers or 1
