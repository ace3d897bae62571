"""Mixture of Experts (`MoEConfig`): Megatron-LM's --moe-* flags with Megatron's names, types,
defaults, choices and rules, and the formulas the rest of the code shares (which layers are
MoE layers, expert parameter counts, active FFN width). Part of `app.config`.

A model has experts when --num-experts is set; `ModelConfig.moe` holds this config (the dense
default: no experts). Rules that need the model's shape are `check_against_model` (called by
`ModelConfig.__post_init__`), rules that need the layout or the engine are `check_moe_run`
(called by `RunConfig.__post_init__`). Options Megatron has but this project does not implement
are accepted by the parser and refused by name when set ("not supported yet"), as are the
choices of that kind (sinkhorn, quantile_balancing, sqrtsoftplus, flex).
"""
from __future__ import annotations

import re
import warnings
from dataclasses import dataclass
from typing import Any, ClassVar, List, Optional, Tuple, Union

from app.config.deepspeed import check_moe_deepspeed
from app.config.options import option

LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none",
                        "quantile_balancing")
"""--moe-router-load-balancing-type values (Megatron-LM main's list)."""
SCORE_FUNCTIONS = ("softmax", "sigmoid", "sqrtsoftplus")
"""--moe-router-score-function values."""
DISPATCHER_TYPES = ("allgather", "alltoall", "flex")
"""--moe-token-dispatcher-type values."""
ROUTER_DTYPES = ("fp32", "fp64")
DROP_POLICIES = ("probs", "position")
AUX_LOSS_NAMES = {"aux_loss": "load_balancing_loss", "seq_aux_loss": "seq_load_balancing_loss",
                  "global_aux_loss": "global_load_balancing_loss"}
"""Load-balancing type -> the name Megatron logs its value under (loss / coeff)."""
NOT_SUPPORTED_CHOICES = {"sinkhorn", "quantile_balancing", "sqrtsoftplus", "flex"}


def moe_freq_type(text: Union[int, str]) -> Union[int, List[int]]:
    """--moe-layer-freq as Megatron reads it: an int N (layer i is an MoE layer when i % N == 0),
    or a Python list expression such as "([0]+[1]*23)" (1 = MoE, 0 = dense) made of digits,
    commas, brackets, parentheses, + and * only (evaluated by a small parser, not eval)."""
    if isinstance(text, int):
        return text
    if "[" not in text:
        try:
            return int(text)
        except ValueError:
            raise _bad_pattern(text, "not an integer") from None
    if re.search(r"[^,\d\[\]()+*\s]", text):
        raise _bad_pattern(text, "only digits, commas, [], (), + and * are allowed")
    value = _PatternParser(text).parse()
    if not isinstance(value, list) or not all(isinstance(v, int) for v in value):
        raise _bad_pattern(text, "it does not give a list of integers")
    return value


def _bad_pattern(text: str, why: str) -> Exception:
    import argparse  # the parser's error type, so argparse prints the usage and exits 2
    return argparse.ArgumentTypeError(f"Invalid pattern: {text} ({why})")


class _PatternParser:
    """expr := term ('+' term)*; term := factor ('*' factor)*; factor := INT | '[' items ']' |
    '(' expr ')', with Python's meaning of + and * on ints and lists."""

    def __init__(self, text: str) -> None:
        self.tokens = re.findall(r"\d+|[\[\](),+*]", text)
        self.pos = 0
        self.text = text

    def parse(self) -> Any:
        value = self._expr()
        if self.pos != len(self.tokens):
            raise _bad_pattern(self.text, f"unexpected {self.tokens[self.pos]!r}")
        return value

    def _peek(self) -> Optional[str]:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def _take(self, expected: Optional[str] = None) -> str:
        token = self._peek()
        if token is None or (expected is not None and token != expected):
            raise _bad_pattern(self.text, f"expected {expected or 'more'}")
        self.pos += 1
        return token

    def _combine(self, left: Any, op: str, right: Any) -> Any:
        try:
            return left + right if op == "+" else left * right
        except TypeError:
            raise _bad_pattern(self.text, f"cannot apply {op} to these operands") from None

    def _expr(self) -> Any:
        value = self._term()
        while self._peek() == "+":
            self._take()
            value = self._combine(value, "+", self._term())
        return value

    def _term(self) -> Any:
        value = self._factor()
        while self._peek() == "*":
            self._take()
            value = self._combine(value, "*", self._factor())
        return value

    def _factor(self) -> Any:
        token = self._take()
        if token.isdigit():
            return int(token)
        if token == "(":
            value = self._expr()
            self._take(")")
            return value
        if token == "[":
            items: List[Any] = []
            while self._peek() != "]":
                items.append(self._expr())
                if self._peek() == ",":
                    self._take()
                elif self._peek() != "]":
                    raise _bad_pattern(self.text, "expected , or ]")
            self._take("]")
            return items
        raise _bad_pattern(self.text, f"unexpected {token!r}")


@dataclass(kw_only=True)
class MoEConfig:
    """Mixture of Experts flags (Megatron-LM's meaning; docs/moe.md)."""

    FLAG_GROUP: ClassVar[Tuple[str, str]] = ("mixture of experts",
                                             "Megatron-LM's MoE flags (docs/moe.md)")

    num_experts: Optional[int] = option(
        "--num-experts", default=None,
        help="routed experts per MoE layer (unset: a dense model)")
    moe_ffn_hidden_size: Optional[int] = option(
        "--moe-ffn-hidden-size", default=None,
        help="width of each routed expert's FFN (with --swiglu of each half); default "
             "--ffn-hidden-size")
    moe_layer_freq: Union[int, List[int]] = option(
        "--moe-layer-freq", default=1, parse=moe_freq_type,
        help="an int N: layer i (from 0) is an MoE layer when i %% N == 0; or a list expression "
             "such as \"([0]+[1]*23)\" with one 0 (dense) or 1 (MoE) per layer")
    moe_router_topk: int = option("--moe-router-topk", default=2,
                                  help="experts each token is routed to (k)")
    moe_router_score_function: str = option(
        "--moe-router-score-function", default="softmax", choices=SCORE_FUNCTIONS,
        help="softmax or sigmoid scores (sigmoid: the k scores renormalised when k > 1)")
    moe_router_pre_softmax: bool = option(
        "--moe-router-pre-softmax", default=False,
        help="softmax over all experts, then top-k (not renormalised); default: top-k on the "
             "logits, then softmax over the k")
    moe_router_topk_scaling_factor: Optional[float] = option(
        "--moe-router-topk-scaling-factor", default=None,
        help="multiply the k routing probabilities by this factor")
    moe_router_dtype: Optional[str] = option(
        "--moe-router-dtype", default=None, choices=ROUTER_DTYPES,
        help="dtype of the router GEMM, the probabilities and the weighted sum of the expert "
             "outputs (default: the model's)")
    moe_router_load_balancing_type: List[str] = option(
        "--moe-router-load-balancing-type", default_factory=lambda: ["aux_loss"], nargs="+",
        choices=LOAD_BALANCING_TYPES,
        help="aux_loss (per micro-batch), seq_aux_loss (per sequence), global_aux_loss (token "
             "counts over data-parallel ranks and micro-batches) or none; several types take "
             "one --moe-aux-loss-coeff each")
    moe_aux_loss_coeff: List[float] = option(
        "--moe-aux-loss-coeff", default_factory=lambda: [0.0], nargs="+",
        help="coefficient of each load-balancing loss (Megatron suggests 1e-2)")
    moe_z_loss_coeff: Optional[float] = option(
        "--moe-z-loss-coeff", default=None,
        help="coefficient of the router z-loss (Megatron suggests 1e-3)")
    moe_router_enable_expert_bias: bool = option(
        "--moe-router-enable-expert-bias", default=False,
        help="aux-loss-free balancing: a per-expert bias that only selects experts, updated "
             "after each iteration by --moe-router-bias-update-rate x sign(mean load - load); "
             "needs --moe-router-score-function sigmoid")
    moe_router_bias_update_rate: float = option("--moe-router-bias-update-rate", default=1e-3)
    moe_token_dispatcher_type: str = option(
        "--moe-token-dispatcher-type", default="allgather", choices=DISPATCHER_TYPES,
        help="allgather: every rank of the expert tensor x expert group gathers all tokens; "
             "alltoall: each token goes only to the ranks of its experts")
    moe_grouped_gemm: bool = option(
        "--moe-grouped-gemm", default=False,
        help="the local experts as one grouped matmul (torch.nn.functional.grouped_mm where the "
             "shapes allow it, else a loop); the same weights and checkpoints")
    moe_expert_capacity_factor: Optional[float] = option(
        "--moe-expert-capacity-factor", default=None,
        help="drop assignments over ceil(tokens x k / experts x factor) per expert, per rank "
             "and micro-batch (unset or negative: dropless)")
    moe_pad_expert_input_to_capacity: bool = option(
        "--moe-pad-expert-input-to-capacity", default=False,
        help="every expert gets exactly its capacity of rows (needs a capacity factor)")
    moe_token_drop_policy: str = option(
        "--moe-token-drop-policy", default="probs", choices=DROP_POLICIES,
        help="over capacity, keep the highest probabilities (probs) or the earliest tokens "
             "(position)")
    moe_shared_expert_intermediate_size: Optional[int] = option(
        "--moe-shared-expert-intermediate-size", default=None,
        help="width of the shared expert every token goes through (Qwen2-MoE, DeepSeek)")
    moe_shared_expert_gate: bool = option(
        "--moe-shared-expert-gate", default=False,
        help="scale the shared expert's output by sigmoid(x . gate_weight)")
    moe_per_layer_logging: bool = option(
        "--moe-per-layer-logging", default=False,
        help="log each layer's load-balancing / z losses and tokens per expert too")
    moe_permute_fusion: bool = option(
        "--moe-permute-fusion", default=False,
        help="accepted for Megatron's scripts: the token permutation here is one index gather "
             "either way")
    moe_router_fusion: bool = option(
        "--moe-router-fusion", default=False,
        help="accepted for Megatron's scripts: the router runs the same unfused arithmetic")
    # Megatron options this project does not implement: parsed, refused when set
    moe_router_num_groups: Optional[int] = option("--moe-router-num-groups", default=None,
                                                  help="group-limited routing: not supported yet")
    moe_router_group_topk: Optional[int] = option("--moe-router-group-topk", default=None,
                                                  help="group-limited routing: not supported yet")
    moe_input_jitter_eps: Optional[float] = option("--moe-input-jitter-eps", default=None,
                                                   help="input jitter: not supported yet")
    moe_shared_expert_overlap: bool = option("--moe-shared-expert-overlap", default=False,
                                             help="not supported yet")
    moe_use_upcycling: bool = option("--moe-use-upcycling", default=False,
                                     help="upcycling a dense checkpoint: not supported yet")
    moe_latent_size: Optional[int] = option("--moe-latent-size", default=None,
                                            help="latent MoE: not supported yet")

    def __post_init__(self) -> None:
        if self.num_experts == 0:  # Megatron's validate_args: 0 means a dense model
            self.num_experts = None
        if self.moe_expert_capacity_factor is not None and self.moe_expert_capacity_factor < 0:
            self.moe_expert_capacity_factor = None  # Megatron: negative means dropless
        self._check_unsupported()
        if self.num_experts is not None and self.num_experts < 0:
            raise ValueError("num_moe_experts must be non-negative. (--num-experts "
                             f"{self.num_experts})")
        if not self.enabled:
            return
        types, coeffs = self.moe_router_load_balancing_type, self.moe_aux_loss_coeff
        if len(types) > 1 and len(coeffs) != len(types):
            raise ValueError("moe_aux_loss_coeff must be a list of the same length as "
                             f"moe_router_load_balancing_type (--moe-aux-loss-coeff {coeffs}, "
                             f"--moe-router-load-balancing-type {types})")
        if len(coeffs) != 1 and len(types) == 1:
            raise ValueError(f"--moe-aux-loss-coeff takes one value per load-balancing type; got "
                             f"{len(coeffs)} for {types}")
        if self.moe_router_topk < 1 or self.moe_router_topk > self.num_experts:
            raise ValueError(f"--moe-router-topk ({self.moe_router_topk}) must be in [1, "
                             f"--num-experts ({self.num_experts})]")
        if (self.moe_router_topk == 1 and self.moe_router_score_function == "softmax"
                and not self.moe_router_pre_softmax):
            raise ValueError("Please use --moe-router-pre-softmax when topk is 1. (A softmax "
                             "over one selected logit is 1 and gives the router no gradient.)")
        if self.moe_router_enable_expert_bias and self.moe_router_score_function != "sigmoid":
            raise ValueError("Expert bias for aux-loss-free routing only supports sigmoid score "
                             "function. Please set --moe-router-score-function sigmoid for "
                             "sigmoid score function.")
        if self.moe_pad_expert_input_to_capacity and self.moe_expert_capacity_factor is None:
            raise ValueError("moe_expert_capacity_factor must be set to use "
                             "moe_pad_expert_input_to_capacity (--moe-expert-capacity-factor)")
        size = self.moe_shared_expert_intermediate_size
        if size is not None and size <= 0:
            raise ValueError("moe_shared_expert_intermediate_size must be num_shared_experts * "
                             f"ffn_size_of_each_shared_expert, but got {size}")
        if self.moe_shared_expert_gate and size is None:
            raise ValueError("--moe-shared-expert-gate needs --moe-shared-expert-intermediate-size")

    def _check_unsupported(self) -> None:
        """Megatron's options that this project does not implement, refused by name."""
        used = [f"--moe-router-load-balancing-type {t}" for t in self.moe_router_load_balancing_type
                if t in NOT_SUPPORTED_CHOICES]
        for flag, value in (("--moe-router-score-function", self.moe_router_score_function),
                            ("--moe-token-dispatcher-type", self.moe_token_dispatcher_type)):
            if value in NOT_SUPPORTED_CHOICES:
                used.append(f"{flag} {value}")
        for flag, value in (("--moe-router-num-groups", self.moe_router_num_groups),
                            ("--moe-router-group-topk", self.moe_router_group_topk),
                            ("--moe-input-jitter-eps", self.moe_input_jitter_eps),
                            ("--moe-latent-size", self.moe_latent_size)):
            if value is not None:
                used.append(flag)
        for flag, on in (("--moe-shared-expert-overlap", self.moe_shared_expert_overlap),
                         ("--moe-use-upcycling", self.moe_use_upcycling)):
            if on:
                used.append(flag)
        if used:
            raise ValueError(f"{', '.join(used)}: not supported yet (docs/moe.md lists what is); "
                             "drop it")

    # ---- derived values ---------------------------------------------------------------------
    @property
    def enabled(self) -> bool:
        """The model has MoE layers (--num-experts set)."""
        return self.num_experts is not None

    def layer_pattern(self, num_layers: int) -> List[bool]:
        """Which of the model's layers are MoE layers (all False without experts): Megatron's
        `i % N == 0` for an int --moe-layer-freq N, the list as given otherwise."""
        if not self.enabled:
            return [False] * num_layers
        freq = self.moe_layer_freq
        if isinstance(freq, int):
            return [i % freq == 0 for i in range(num_layers)]
        return [bool(v) for v in freq]

    def num_moe_layers(self, num_layers: int) -> int:
        return sum(self.layer_pattern(num_layers))

    def aux_loss_coeff(self, kind: str) -> float:
        """The coefficient of load-balancing type `kind` (0 when that type is not used)."""
        types, coeffs = self.moe_router_load_balancing_type, self.moe_aux_loss_coeff
        if kind not in types:
            return 0.0
        return float(coeffs[types.index(kind)] if len(coeffs) > 1 else coeffs[0])

    @property
    def tracked_losses(self) -> List[str]:
        """The names Megatron logs for this config, in its order: the load-balancing losses of
        the types in use, then z_loss when --moe-z-loss-coeff is set."""
        if not self.enabled:
            return []
        names = [name for kind, name in AUX_LOSS_NAMES.items()
                 if kind in self.moe_router_load_balancing_type]
        return names + (["z_loss"] if self.moe_z_loss_coeff is not None else [])

    @property
    def shared_expert_size(self) -> int:
        """Width of the shared expert (0 without one)."""
        return self.moe_shared_expert_intermediate_size or 0

    def check_against_model(self, num_layers: int, ffn_hidden_size: int, add_bias_linear: bool
                            ) -> None:
        """The rules that need the model's shape; sets --moe-ffn-hidden-size's default (a
        construction default, as Megatron's)."""
        if not self.enabled:
            if self.moe_ffn_hidden_size is not None:
                raise ValueError("moe_ffn_hidden_size is set but num_moe_experts is None. Please "
                                 "set num_moe_experts or remove moe_ffn_hidden_size. "
                                 "(--moe-ffn-hidden-size needs --num-experts)")
            return
        if self.moe_ffn_hidden_size is None:
            warnings.warn("moe_ffn_hidden_size is not set, using ffn_hidden_size for MoE "
                          "instead.")
            self.moe_ffn_hidden_size = ffn_hidden_size
        if self.moe_ffn_hidden_size <= 0:
            raise ValueError(f"--moe-ffn-hidden-size must be positive, got "
                             f"{self.moe_ffn_hidden_size}")
        freq = self.moe_layer_freq
        if isinstance(freq, int) and freq <= 0:
            raise ValueError(f"--moe-layer-freq must be positive, got {freq}")
        if isinstance(freq, list):
            if len(freq) != num_layers:
                raise ValueError(f"Invalid length of moe_layer_pattern: {len(freq)}, expected "
                                 f"{num_layers}, current moe layer pattern: {freq} "
                                 "(--moe-layer-freq needs one entry per --num-layers)")
            if any(v not in (0, 1) for v in freq):
                raise ValueError(f"--moe-layer-freq list entries must be 0 (dense) or 1 (MoE), "
                                 f"got {freq}")
        if add_bias_linear:
            raise ValueError("--num-experts: experts and routers with biases are not supported "
                             "yet; add --disable-bias-linear (as Megatron's MoE examples do)")

    def expert_numels(self, hidden_size: int, swiglu: bool,
                      expert_model_parallel_size: int = 1,
                      expert_tensor_parallel_size: int = 1) -> List[int]:
        """Sizes of one MoE layer's expert weights on one rank: fc1 [E/EP, 2F/ETP (or F), H],
        fc2 [E/EP, H, F/ETP]."""
        local = self.num_experts // expert_model_parallel_size
        width = self.moe_ffn_hidden_size // expert_tensor_parallel_size
        return [local * width * (2 if swiglu else 1) * hidden_size, local * hidden_size * width]

    def active_ffn_width(self) -> int:
        """FFN width a token goes through in an MoE layer: k x --moe-ffn-hidden-size plus the
        shared expert (Megatron's FLOP formula counts these, not the router)."""
        return self.moe_router_topk * self.moe_ffn_hidden_size + self.shared_expert_size


def check_moe_run(moe: MoEConfig, model: Any, parallel: Any, deepspeed: Any,
                  optimizer: Any) -> None:
    """The rules between MoE and the layout, the engine and the optimizer (RunConfig calls it):
    Megatron's words where Megatron has the rule."""
    tp, pp = parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size
    ep, etp = parallel.expert_model_parallel_size, parallel.expert_tensor_parallel_size
    if not moe.enabled:
        if ep > 1:
            raise ValueError("num_experts must be non None to use expert model parallelism "
                             f"(--expert-model-parallel-size {ep} needs --num-experts)")
        return
    if moe.num_experts % ep:
        raise ValueError(f"Number of experts should be a multiple of expert model parallel_size. "
                         f"(--num-experts {moe.num_experts}, --expert-model-parallel-size {ep})")
    if parallel.world_size % (etp * ep * pp):
        raise ValueError(f"world_size ({parallel.world_size}) is not divisible by "
                         f"expert_tensor_model_pipeline_parallel size ({etp * ep * pp} = "
                         f"--expert-tensor-parallel-size {etp} x --expert-model-parallel-size "
                         f"{ep} x --pipeline-model-parallel-size {pp})")
    if moe.moe_ffn_hidden_size % etp:
        raise ValueError(f"--moe-ffn-hidden-size ({moe.moe_ffn_hidden_size}) is not divisible by "
                         f"--expert-tensor-parallel-size ({etp})")
    shared = moe.moe_shared_expert_intermediate_size
    if shared is not None and shared % tp:
        raise ValueError(f"--moe-shared-expert-intermediate-size ({shared}) is not divisible by "
                         f"--tensor-model-parallel-size ({tp})")
    if tp > 1 and not model.sequence_parallel:
        raise ValueError("During training, performance may degrade if MoE and tensor parallelism"
                         "are enabled without also enabling sequence parallelism. (add "
                         "--sequence-parallel)")
    if deepspeed.enabled:
        check_moe_deepspeed(deepspeed, parallel)
    if optimizer.optimizer == "muon" and deepspeed.enabled:
        raise ValueError("--optimizer muon with --num-experts under --deepspeed: DeepSpeed's "
                         "Muon orthogonalises 2-D weights only and would step the experts with "
                         "AdamW; use the native path for Muon (per-expert orthogonalisation), "
                         "or AdamW under DeepSpeed")
