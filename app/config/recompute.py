"""Activation recompute: the rules of Megatron's recompute flags (`check_recompute`), what a
model chunk recomputes (`recompute_plan`) and Megatron's two spellings of full recompute
(`resolve_recompute_flags`). Pure; part of `app.config`.

--recompute-granularity selective recomputes the modules --recompute-modules names in every
layer (Megatron's default: core_attn): `core_attn` the attention core (QK^T, softmax, dropout,
AV), `mlp` a dense layer's MLP, `moe` a whole MoE layer (router, dispatch, experts, combine,
shared expert), `shared_experts` the shared expert of an MoE layer (inside `moe` when both are
named). --moe-layer-recompute (deprecated in Megatron) means selective with `moe` added.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

from app.config.rules import positive

RECOMPUTE_GRANULARITIES = ("full", "selective")
"""--recompute-granularity values (unset: no recompute)."""
RECOMPUTE_METHODS = ("uniform", "block")
"""--recompute-method values (with full recompute)."""
RECOMPUTE_MODULES = ("core_attn", "mlp", "moe", "shared_experts")
"""--recompute-modules values this project recomputes (module docstring)."""
MEGATRON_ONLY_MODULES: Dict[str, str] = {
    "moe_act": "recomputing the experts' activation needs an output-discarding checkpoint, "
               "which this project does not have yet (use moe or mlp)",
    "layernorm": "recomputing the norms needs an output-discarding checkpoint, which this "
                 "project does not have yet",
    "mla_up_proj": "it needs multi-latent attention, which this project does not have "
                   "(Megatron refuses it without --multi-latent-attention too)",
    "gdn_norm_out": "it needs a GatedDeltaNet attention variant, which this project does not "
                    "have (Megatron refuses it without one too)",
    "gdp_in_proj": "it needs a GatedDeltaProduct attention variant, which this project does "
                   "not have",
    "gdp_qkv": "it needs a GatedDeltaProduct attention variant, which this project does not "
               "have",
    "mhc": "it needs hyper-connections, which this project does not have (Megatron refuses it "
           "without --enable-mhc-connections too)"}
"""--recompute-modules values Megatron-LM accepts that this project refuses, and why."""


def check_recompute(m: Any) -> None:
    """The recompute flags of ModelConfig `m` agree (Megatron's rules); sets the construction
    defaults (full: uniform, 1 layer) and applies --moe-layer-recompute (selective + moe)."""
    if m.recompute_granularity not in (None,) + RECOMPUTE_GRANULARITIES:
        raise ValueError(f"--recompute-granularity must be one of "
                         f"{', '.join(RECOMPUTE_GRANULARITIES)}, got {m.recompute_granularity!r}")
    if m.recompute_method not in (None,) + RECOMPUTE_METHODS:
        raise ValueError(f"--recompute-method must be one of {', '.join(RECOMPUTE_METHODS)}, "
                         f"got {m.recompute_method!r}")
    if m.moe_layer_recompute:
        if m.recompute_granularity == "full":
            raise ValueError("Do not set --moe-layer-recompute with full recompute granularity. "
                             "(--moe-layer-recompute means --recompute-granularity selective "
                             "--recompute-modules ... moe: drop one of the two)")
        warnings.warn("--moe-layer-recompute is deprecated. Use --recompute-granularity "
                      "selective --recompute-modules moe instead.")
        m.recompute_granularity = "selective"  # Megatron's rewrite, idempotent
        if "moe" not in m.recompute_modules:
            m.recompute_modules = [*m.recompute_modules, "moe"]
    if m.recompute_granularity == "selective":
        _check_modules(m.recompute_modules)
    if m.recompute_granularity == "full":  # construction defaults, as ffn_hidden_size
        m.recompute_method = m.recompute_method or "uniform"
        m.recompute_num_layers = m.recompute_num_layers or 1
        positive(m, (("recompute_num_layers", "--recompute-num-layers"),))
        return
    given = [flag for flag, value in (("--recompute-method", m.recompute_method),
                                      ("--recompute-num-layers", m.recompute_num_layers))
             if value is not None]
    if given:
        raise ValueError(
            f"{' and '.join(given)} apply to --recompute-granularity full only (got "
            f"{m.recompute_granularity or 'no recompute'}); selective recompute always "
            "recomputes the --recompute-modules of every layer: drop "
            f"{' and '.join(given)} or use --recompute-granularity full")


def _check_modules(modules: List[str]) -> None:
    """--recompute-modules names modules this project recomputes."""
    for name in modules:
        if name in MEGATRON_ONLY_MODULES:
            raise ValueError(f"--recompute-modules {name}: not supported here: "
                             f"{MEGATRON_ONLY_MODULES[name]}; drop it (supported: "
                             f"{', '.join(RECOMPUTE_MODULES)})")
        if name not in RECOMPUTE_MODULES:
            raise ValueError(f"--recompute-modules {name}: unknown module; choose from "
                             f"{', '.join(RECOMPUTE_MODULES)}")


def selective_modules(m: Any) -> Tuple[str, ...]:
    """The modules ModelConfig `m` recomputes in every layer (none without selective)."""
    return tuple(m.recompute_modules) if m.recompute_granularity == "selective" else ()


def idle_recompute_modules(m: Any) -> List[str]:
    """Selective modules of ModelConfig `m` that find nothing to recompute in its layers: mlp
    without dense layers, moe and shared_experts without MoE layers, shared_experts without a
    shared expert (or inside a recomputed moe)."""
    pattern = m.moe.layer_pattern(m.num_layers)
    modules = selective_modules(m)
    present = {"core_attn": True, "mlp": not all(pattern), "moe": any(pattern),
               "shared_experts": (any(pattern) and bool(m.moe.shared_expert_size)
                                  and "moe" not in modules)}
    return [name for name in modules if not present.get(name, True)]


def regions_per_layer(m: Any, is_moe: bool) -> int:
    """Checkpoint calls that selective recompute makes in one layer of ModelConfig `m` (a
    dense or an MoE layer)."""
    modules = selective_modules(m)
    shared = ("shared_experts" in modules and "moe" not in modules
              and bool(m.moe.shared_expert_size))
    return (("core_attn" in modules) + (("moe" in modules or shared) if is_moe
                                        else ("mlp" in modules)))


@dataclass(frozen=True)
class RecomputePlan:
    """What one model chunk's forward (its consecutive layers) recomputes in backward."""

    granularity: str
    """none, selective (every layer's `modules`) or full (the chunks marked below)."""
    chunks: Tuple[Tuple[int, bool], ...]
    """The chunk's layers in order, as (consecutive layers, run through one checkpoint?)."""
    modules: Tuple[str, ...] = ()
    """With selective: the --recompute-modules recomputed in every layer."""
    selective_regions: int = 0
    """With selective: checkpoint calls in one forward of the chunk (at most: counted on the
    model's layers with the most of them)."""

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
        """Checkpoint calls in one forward: each layer's recomputed modules (selective), one per
        recomputed chunk (full), 0 without recompute."""
        if self.granularity == "selective":
            return self.selective_regions
        return sum(1 for _, recomputed in self.chunks if recomputed)


def recompute_plan(config: Any, layers: int) -> RecomputePlan:
    """The recompute of a model chunk of `layers` consecutive layers (a pipeline stage, or one
    virtual stage with interleaving), as Megatron-LM does it: full uniform checkpoints chunks
    of recompute_num_layers layers (the last may be shorter); full block checkpoints the first
    recompute_num_layers layers one by one and keeps the others; selective recomputes every
    layer's --recompute-modules and checkpoints no whole layer."""
    if config.recompute_granularity != "full":
        kinds = set(config.moe.layer_pattern(config.num_layers)) or {False}
        per_layer = max(regions_per_layer(config, is_moe) for is_moe in kinds)
        return RecomputePlan(config.recompute, ((layers, False),) if layers else (),
                             selective_modules(config), per_layer * layers)
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
