"""FP8 training through NVIDIA Transformer Engine (`Fp8Config`): Megatron-LM's --fp8-* flags
with its names, defaults, choices and rules. Part of `app.config`.

This project does not run FP8 yet (docs/fp8.md has the design): the flags are accepted, the
--dry-run of a GPU world counts them (memory, the recipe), and a run on a machine without
Transformer Engine and an FP8-capable GPU stops before it starts, naming the flag
(`Fp8Config.requirement`, asked by app.training.pretrain through app.launch.hardware)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, List, Optional, Tuple

from app.config.options import option
from app.config.rules import positive

FP8_FORMATS = ("e4m3", "hybrid")
"""--fp8-format values: e4m3 everywhere, or e4m3 forward and e5m2 for the gradients."""
FP8_RECIPES = ("tensorwise", "delayed", "mxfp8", "blockwise", "custom")
"""--fp8-recipe values (Megatron's)."""
FP8_AMAX_ALGOS = ("most_recent", "max")
"""--fp8-amax-compute-algo values."""
FP8_COMPUTE_CAPABILITY = (8, 9)
"""The first CUDA compute capability with FP8 tensor cores (Ada, Hopper and later)."""


@dataclass(kw_only=True)
class Fp8Config:
    """FP8 GEMMs of the transformer layers through Transformer Engine (Megatron's recipe)."""

    FLAG_GROUP: ClassVar[Tuple[str, str]] = (
        "fp8", "FP8 through Transformer Engine (Megatron-LM's flags; needs NVIDIA GPUs with FP8 "
               "tensor cores and transformer_engine; docs/fp8.md)")

    fp8: Optional[str] = option(
        "--fp8-format", default=None, choices=FP8_FORMATS, dest="fp8",
        help="FP8 GEMMs in the transformer layers: e4m3 for every FP8 tensor, or hybrid (e4m3 "
             "activations and weights, e5m2 gradients)")
    fp8_recipe: str = option("--fp8-recipe", default="delayed", choices=FP8_RECIPES,
                             help="Transformer Engine scaling recipe")
    fp8_margin: int = option("--fp8-margin", default=0,
                             help="margin of the scaling factor (delayed scaling)")
    fp8_interval: int = option(
        "--fp8-interval", default=1,
        help="deprecated since Transformer Engine 1.8 and ignored, as in Megatron-LM")
    fp8_amax_history_len: int = option(
        "--fp8-amax-history-len", default=1,
        help="amax history window of delayed scaling (Megatron's default 1)")
    fp8_amax_compute_algo: str = option(
        "--fp8-amax-compute-algo", default="most_recent", choices=FP8_AMAX_ALGOS,
        help="amax of the window: most_recent or max")
    fp8_wgrad: bool = option(
        "--no-fp8-wgrad", "--disable-fp8-wgrad", default=True, action="store_false",
        dest="fp8_wgrad", help="weight gradients in higher precision instead of FP8")
    fp8_param_gather: bool = option(
        "--fp8-param-gather", default=False,
        help="keep the linear weights in FP8 and all-gather them in FP8 (distributed optimizer)")
    first_last_layers_bf16: bool = option(
        "--first-last-layers-bf16", default=False,
        help="keep the first and last layers (the counts below) in bf16")
    num_layers_at_start_in_bf16: int = option("--num-layers-at-start-in-bf16", default=1)
    num_layers_at_end_in_bf16: int = option("--num-layers-at-end-in-bf16", default=1)

    def __post_init__(self) -> None:
        positive(self, (("fp8_amax_history_len", "--fp8-amax-history-len"),))
        if self.fp8_margin < 0:
            raise ValueError(f"--fp8-margin must be >= 0, got {self.fp8_margin}")

    @property
    def enabled(self) -> bool:
        """FP8 requested (--fp8-format given)."""
        return self.fp8 is not None

    def flags(self) -> List[str]:
        """The FP8 flags in effect, as a command line would give them (for messages)."""
        if not self.enabled:
            return []
        out = [f"--fp8-format {self.fp8}"]
        for flag, value, default in (("--fp8-recipe", self.fp8_recipe, "delayed"),
                                     ("--fp8-margin", self.fp8_margin, 0),
                                     ("--fp8-amax-history-len", self.fp8_amax_history_len, 1),
                                     ("--fp8-amax-compute-algo", self.fp8_amax_compute_algo,
                                      "most_recent")):
            if value != default:
                out.append(f"{flag} {value}")
        out += [flag for flag, on in (("--no-fp8-wgrad", not self.fp8_wgrad),
                                      ("--fp8-param-gather", self.fp8_param_gather),
                                      ("--first-last-layers-bf16", self.first_last_layers_bf16))
                if on]
        return out

    def recipe(self) -> str:
        """One line: the recipe Transformer Engine would be given (Megatron's fp8_utils)."""
        formats = ("E4M3 forward, E5M2 gradients (HYBRID)" if self.fp8 == "hybrid"
                   else "E4M3 everywhere")
        wgrad = "in FP8" if self.fp8_wgrad else "in bf16 (--no-fp8-wgrad)"
        return (f"FP8 {formats}, {self.fp8_recipe} scaling (margin {self.fp8_margin}, amax "
                f"history {self.fp8_amax_history_len}, {self.fp8_amax_compute_algo}), weight "
                f"gradients {wgrad}, on the QKV, attention-output and both MLP GEMMs of every "
                "layer" + (f" but the first {self.num_layers_at_start_in_bf16} and last "
                           f"{self.num_layers_at_end_in_bf16}" if self.first_last_layers_bf16
                           else "") + " (embedding, output layer and attention core stay bf16)")

    def requirement(self, cuda_capability: Optional[Tuple[int, int]], te_imports: bool
                    ) -> Optional[str]:
        """Why this machine cannot run these FP8 flags (None when it can, or without FP8):
        `cuda_capability` of its GPU (None: no CUDA device), `te_imports` whether
        transformer_engine.pytorch imports. One line, naming the flags and what they need."""
        if not self.enabled:
            return None
        flags = " ".join(self.flags())
        needs = ("needs NVIDIA Transformer Engine (transformer_engine.pytorch) on GPUs with FP8 "
                 "tensor cores (compute capability >= 8.9)")
        if cuda_capability is None:
            have = "this machine has no CUDA device"
        elif tuple(cuda_capability) < FP8_COMPUTE_CAPABILITY:
            have = f"this GPU is compute capability {cuda_capability[0]}.{cuda_capability[1]}"
        elif not te_imports:
            have = "transformer_engine is not installed"
        else:
            return (f"{flags}: FP8 training through Transformer Engine is not implemented in "
                    "this project yet (docs/fp8.md has the design); drop the FP8 flags to train "
                    "in bf16")
        return (f"{flags} {needs}; {have}: drop the FP8 flags to train in bf16 here, or run on "
                "such GPUs")
