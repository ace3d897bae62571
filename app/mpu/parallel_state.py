"""Process groups of a tensor x context x data x pipeline layout (Megatron Core's rank order,
"tp-cp-ep-dp-pp"), and with Mixture of Experts the expert grid beside it.

Global rank r of a world of size W = TP * CP * DP * PP is laid out as

    r = pp_rank * (DP * CP * TP) + dp_rank * (CP * TP) + cp_rank * TP + tp_rank

so tensor-parallel ranks are adjacent (they share a node), then context-parallel (ranks
holding other chunks of the same sequences), then data-parallel, then pipeline. Gradients are
averaged over data x context ranks ("data_context": every rank holding the same weights).
`rank_layout` is the pure arithmetic (unit-tested without processes); `initialize_model_parallel`
creates the torch.distributed groups and returns a `ParallelState`, which is also the object
passed to DeepSpeed as `mpu=` (it has the `get_model_parallel_*` / `get_data_parallel_*` methods).

Experts live on their own grid over the same ranks (Megatron Core's "MoE parallel folding"):

    r = pp_rank * (EDP * EP * ETP) + edp_rank * (EP * ETP) + ep_rank * ETP + etp_rank

with ETP the expert tensor-parallel size (default TP), EP the expert-parallel size and
EDP = W / (ETP * EP * PP) the expert data-parallel size; both grids share the pipeline groups.
`expert_rank_layout` is its arithmetic (unit-tested against megatron.core's RankGenerator).

`ParallelState.single()` is the one-process state: every size 1, every group None; all of
`app.mpu` then runs without torch.distributed being initialised.
"""
from __future__ import annotations

import dataclasses
import datetime
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import torch.distributed as dist

ProcessGroup = Any  # torch.distributed.ProcessGroup, or None for "just this process"


def rank_layout(world_size: int, tensor_model_parallel_size: int,
                pipeline_model_parallel_size: int,
                context_parallel_size: int = 1) -> Dict[str, List[List[int]]]:
    """Global ranks of every group of each kind, in Megatron Core's order (pure arithmetic).

    Returns {"tensor", "context", "data", "data_context", "pipeline", "model", "embedding"} ->
    list of rank lists. "model" is TP x PP (everything sharing one data and context index);
    "data_context" is DP x CP (the gradient all-reduce group); "embedding" holds the first and
    last stage of each pipeline (just the one stage when PP = 1).
    """
    tp, pp, cp = tensor_model_parallel_size, pipeline_model_parallel_size, context_parallel_size
    for name, value in (("world size", world_size), ("tensor_model_parallel_size", tp),
                        ("pipeline_model_parallel_size", pp), ("context_parallel_size", cp)):
        if value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")
    if world_size % (tp * pp * cp):
        raise ValueError(
            f"world size ({world_size}) is not divisible by tensor_model_parallel_size ({tp}) x "
            f"pipeline_model_parallel_size ({pp}) x context_parallel_size ({cp})")
    dp = world_size // (tp * pp * cp)

    def rank(t: int, d: int, p: int, c: int = 0) -> int:
        return ((p * dp + d) * cp + c) * tp + t

    tensor = [[rank(t, d, p, c) for t in range(tp)]
              for p in range(pp) for d in range(dp) for c in range(cp)]
    context = [[rank(t, d, p, c) for c in range(cp)]
               for p in range(pp) for d in range(dp) for t in range(tp)]
    data = [[rank(t, d, p, c) for d in range(dp)]
            for p in range(pp) for c in range(cp) for t in range(tp)]
    data_context = [[rank(t, d, p, c) for d in range(dp) for c in range(cp)]
                    for p in range(pp) for t in range(tp)]
    pipeline = [[rank(t, d, p, c) for p in range(pp)]
                for d in range(dp) for c in range(cp) for t in range(tp)]
    model = [[rank(t, d, p, c) for p in range(pp) for t in range(tp)]
             for d in range(dp) for c in range(cp)]
    embedding = [sorted({ranks[0], ranks[-1]}) for ranks in pipeline]
    return {"tensor": tensor, "context": context, "data": data, "data_context": data_context,
            "pipeline": pipeline, "model": model, "embedding": embedding}


def expert_rank_layout(world_size: int, tensor_model_parallel_size: int,
                       pipeline_model_parallel_size: int, context_parallel_size: int = 1,
                       expert_model_parallel_size: int = 1,
                       expert_tensor_parallel_size: Optional[int] = None
                       ) -> Dict[str, List[List[int]]]:
    """Global ranks of the groups Mixture of Experts uses (pure arithmetic), in Megatron Core's
    order: {"expert_tensor" (ETP), "expert" (EP), "expert_tensor_and_expert" (ETP x EP: the
    token dispatchers' group), "expert_data" (EDP: expert gradients are summed over it),
    "expert_model" (ETP x EP x PP: the experts' part of the gradient norm), "tensor_context"
    (TP x CP: the load-balancing token counts), "tensor_data_context" (TP x DP x CP: global
    load balancing and the expert bias)}.
    """
    tp, pp, cp = tensor_model_parallel_size, pipeline_model_parallel_size, context_parallel_size
    ep, etp = expert_model_parallel_size, expert_tensor_parallel_size or tp
    for name, value in (("expert_model_parallel_size", ep), ("expert_tensor_parallel_size", etp)):
        if value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")
    if world_size % (etp * ep * pp):
        raise ValueError(f"world_size ({world_size}) is not divisible by "
                         f"expert_tensor_model_pipeline_parallel size ({etp * ep * pp})")
    rank_layout(world_size, tp, pp, cp)  # the dense grid's checks
    edp = world_size // (etp * ep * pp)

    def rank(t: int, e: int, d: int, p: int) -> int:
        return ((p * edp + d) * ep + e) * etp + t

    grid = [(t, e, d, p) for p in range(pp) for d in range(edp) for e in range(ep)
            for t in range(etp)]

    def groups(varying: str) -> List[List[int]]:
        """Rank lists of the groups along the dimensions in `varying` (of "tedp")."""
        found: Dict[tuple, List[int]] = {}
        for t, e, d, p in grid:
            fixed = tuple(v for k, v in zip("tedp", (t, e, d, p)) if k not in varying)
            found.setdefault(fixed, []).append(rank(t, e, d, p))
        return [sorted(ranks) for ranks in found.values()]

    dp = world_size // (tp * cp * pp)
    dense_rank = lambda t, c, d, p: ((p * dp + d) * cp + c) * tp + t  # noqa: E731
    tensor_context = [[dense_rank(t, c, d, p) for c in range(cp) for t in range(tp)]
                      for p in range(pp) for d in range(dp)]
    tensor_data_context = [list(range(p * tp * cp * dp, (p + 1) * tp * cp * dp))
                           for p in range(pp)]
    return {"expert_tensor": groups("t"), "expert": groups("e"),
            "expert_tensor_and_expert": groups("te"), "expert_data": groups("d"),
            "expert_model": groups("tep"), "tensor_context": tensor_context,
            "tensor_data_context": tensor_data_context}


@dataclass
class ParallelState:
    """Sizes, ranks and process groups of this rank in a TP x CP x DP x PP layout.

    Groups are None when the layout has a single process; `app.mpu.collectives` treats a None
    group (or a group of one rank) as "nothing to communicate".
    """

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    data_parallel_size: int = 1
    tensor_model_parallel_rank: int = 0
    pipeline_model_parallel_rank: int = 0
    data_parallel_rank: int = 0
    rank: int = 0
    """Global rank."""
    tensor_model_parallel_group: ProcessGroup = None
    pipeline_model_parallel_group: ProcessGroup = None
    data_parallel_group: ProcessGroup = None
    model_parallel_group: ProcessGroup = None
    """TP x PP group: all ranks holding one replica of the model."""
    embedding_group: ProcessGroup = None
    """First and last pipeline stage of this pipeline (tied word embeddings)."""
    pipeline_ranks: List[int] = field(default_factory=lambda: [0])
    """Global ranks of this rank's pipeline, stage 0 first (for point-to-point)."""
    tensor_model_parallel_ranks: List[int] = field(default_factory=lambda: [0])
    """Global ranks of this rank's tensor-parallel group (src for broadcasts is ranks[0])."""
    data_parallel_ranks: List[int] = field(default_factory=lambda: [0])
    virtual_pipeline_model_parallel_size: int = 1
    """Model chunks per pipeline rank (interleaved 1F1B when > 1)."""
    context_parallel_size: int = 1
    """Ranks sharing each sequence (app.mpu.context_parallel); 1 = no context parallelism."""
    context_parallel_rank: int = 0
    context_parallel_group: ProcessGroup = None
    context_parallel_ranks: List[int] = field(default_factory=lambda: [0])
    """Global ranks of this rank's context group, in context-rank order (ring neighbours)."""
    data_context_parallel_group: ProcessGroup = None
    """DP x CP: every rank holding the same weights (gradients are averaged over it)."""
    data_context_parallel_rank: int = 0
    cp_comm_type: str = "p2p"
    """Context-parallel attention: "p2p" (key/value ring) or "a2a" (all-to-all over heads)."""
    # ---- the expert grid (Mixture of Experts; see the module docstring) -----------------------
    expert_model_parallel_size: int = 1
    expert_model_parallel_rank: int = 0
    expert_model_parallel_group: ProcessGroup = None
    """EP: the ranks holding the other experts of each MoE layer."""
    expert_tensor_parallel_size: int = 1
    expert_tensor_parallel_rank: int = 0
    expert_tensor_parallel_group: ProcessGroup = None
    """ETP: the ranks holding the other shards of each expert's FFN."""
    expert_tensor_and_expert_group: ProcessGroup = None
    """ETP x EP: the token dispatchers' group (its rank = etp + ETP x ep)."""
    expert_data_parallel_size: int = 1
    expert_data_parallel_rank: int = 0
    expert_data_parallel_group: ProcessGroup = None
    """EDP: the ranks holding the same experts (their gradients are summed over it)."""
    expert_model_group: ProcessGroup = None
    """ETP x EP x PP: one replica of every expert (the experts' share of the gradient norm)."""
    tensor_context_group: ProcessGroup = None
    """TP x CP: ranks routing other tokens of the same micro-batch (load-balancing counts)."""
    tensor_data_context_group: ProcessGroup = None
    """TP x DP x CP: every rank of a pipeline stage (global load balancing, expert bias)."""

    @classmethod
    def single(cls) -> "ParallelState":
        """The one-process state: every size 1, every rank 0, every group None."""
        return cls()

    def __deepcopy__(self, memo: dict) -> "ParallelState":
        # Process groups cannot be copied; a deep-copied model shares its layout.
        return self

    # ---- derived sizes and stage predicates -------------------------------------------------
    @property
    def world_size(self) -> int:
        return (self.tensor_model_parallel_size * self.pipeline_model_parallel_size
                * self.data_parallel_size * self.context_parallel_size)

    def gradient_state(self) -> "ParallelState":
        """This state with the data-parallel group widened to data x context (what gradients
        are averaged and the distributed optimizer sharded over, as Megatron Core does); the
        state itself without context parallelism."""
        if self.context_parallel_size == 1:
            return self
        return dataclasses.replace(
            self, data_parallel_group=self.data_context_parallel_group,
            data_parallel_size=self.data_parallel_size * self.context_parallel_size,
            data_parallel_rank=self.data_context_parallel_rank,
            context_parallel_size=1, context_parallel_rank=0, context_parallel_group=None,
            context_parallel_ranks=[self.rank])

    @property
    def model_parallel_size(self) -> int:
        """TP x PP: ranks holding one replica of the model."""
        return self.tensor_model_parallel_size * self.pipeline_model_parallel_size

    @property
    def model_parallel_rank(self) -> int:
        """Rank inside the TP x PP group (Megatron's order: pp_rank * TP + tp_rank)."""
        return (self.pipeline_model_parallel_rank * self.tensor_model_parallel_size
                + self.tensor_model_parallel_rank)

    def is_pipeline_first_stage(self) -> bool:
        return self.pipeline_model_parallel_rank == 0

    def is_pipeline_last_stage(self) -> bool:
        return self.pipeline_model_parallel_rank == self.pipeline_model_parallel_size - 1

    def pipeline_next_rank(self) -> Optional[int]:
        """Global rank of the next stage, or None on the last stage."""
        if self.is_pipeline_last_stage():
            return None
        return self.pipeline_ranks[self.pipeline_model_parallel_rank + 1]

    def pipeline_prev_rank(self) -> Optional[int]:
        """Global rank of the previous stage, or None on the first stage."""
        if self.is_pipeline_first_stage():
            return None
        return self.pipeline_ranks[self.pipeline_model_parallel_rank - 1]

    @property
    def tensor_model_parallel_src_rank(self) -> int:
        """Global rank of TP rank 0 of this group (source of data broadcasts)."""
        return self.tensor_model_parallel_ranks[0]

    # ---- DeepSpeed's `mpu=` interface (and Megatron's names) ----------------------------------
    # "Model parallel" for DeepSpeed means TP x PP (its checkpoint file numbers and norm
    # all-reduces); it counts replicated weights by get_tensor_model_parallel_rank().
    def get_model_parallel_rank(self) -> int:
        return self.model_parallel_rank

    def get_model_parallel_world_size(self) -> int:
        return self.model_parallel_size

    def get_model_parallel_group(self) -> ProcessGroup:
        return self.model_parallel_group

    def get_data_parallel_rank(self) -> int:
        return self.data_parallel_rank

    def get_data_parallel_world_size(self) -> int:
        return self.data_parallel_size

    def get_data_parallel_group(self) -> ProcessGroup:
        return self.data_parallel_group

    # DeepSpeed's group for ZeRO's partitions and the gradient reduction ("sequence data
    # parallel"): data x context, as Megatron Core reduces over; with no sequence-parallel
    # size given, DeepSpeed averages over all of it (our loss carries the factor C)
    def get_sequence_data_parallel_group(self) -> ProcessGroup:
        return self.gradient_state().data_parallel_group

    def get_sequence_data_parallel_world_size(self) -> int:
        return self.gradient_state().data_parallel_size

    def get_sequence_data_parallel_rank(self) -> int:
        return self.gradient_state().data_parallel_rank

    def get_tensor_model_parallel_rank(self) -> int:
        return self.tensor_model_parallel_rank

    def get_tensor_model_parallel_world_size(self) -> int:
        return self.tensor_model_parallel_size

    def get_tensor_model_parallel_group(self) -> ProcessGroup:
        return self.tensor_model_parallel_group

    def get_tensor_model_parallel_src_rank(self) -> int:
        return self.tensor_model_parallel_src_rank

    def get_pipeline_model_parallel_rank(self) -> int:
        return self.pipeline_model_parallel_rank

    def get_pipeline_model_parallel_world_size(self) -> int:
        return self.pipeline_model_parallel_size

    def get_pipeline_model_parallel_group(self) -> ProcessGroup:
        return self.pipeline_model_parallel_group


_CURRENT: ParallelState = ParallelState.single()


def get_parallel_state() -> ParallelState:
    """The state set by the last `initialize_model_parallel` (ParallelState.single() before)."""
    return _CURRENT


def set_parallel_state(state: ParallelState) -> None:
    """Make `state` the default used where a function's `parallel_state` argument is None."""
    global _CURRENT
    _CURRENT = state


def destroy_model_parallel() -> None:
    """Forget the current layout (the default goes back to ParallelState.single())."""
    set_parallel_state(ParallelState.single())


def initialize_model_parallel(tensor_model_parallel_size: int = 1,
                              pipeline_model_parallel_size: int = 1,
                              virtual_pipeline_model_parallel_size: int = 1,
                              timeout: Optional[datetime.timedelta] = None,
                              context_parallel_size: int = 1,
                              cp_comm_type: str = "p2p",
                              expert_model_parallel_size: int = 1,
                              expert_tensor_parallel_size: Optional[int] = None,
                              experts: bool = False) -> ParallelState:
    """Create the TP / CP / DP / DPxCP / PP / model / embedding groups of this world (and with
    `experts` the expert grid's, `expert_rank_layout`: EP and ETP, default TP); return this
    rank's state.

    Must run on every rank after `torch.distributed.init_process_group` (group creation is
    collective). Every collective on these groups fails after `timeout` (torch's default for
    new groups when None) instead of waiting forever for a stopped rank. The returned state
    also becomes the default (`get_parallel_state()`).
    `virtual_pipeline_model_parallel_size` (model chunks per pipeline rank) is only recorded.
    """
    if not dist.is_available() or not dist.is_initialized():
        if (tensor_model_parallel_size == 1 and pipeline_model_parallel_size == 1
                and context_parallel_size == 1):
            state = ParallelState.single()
            set_parallel_state(state)
            return state
        raise RuntimeError(
            f"tensor_model_parallel_size ({tensor_model_parallel_size}) x "
            f"pipeline_model_parallel_size ({pipeline_model_parallel_size}) > 1 needs "
            "torch.distributed.init_process_group() first (launch with torchrun)")
    world_size, rank = dist.get_world_size(), dist.get_rank()
    layout = rank_layout(world_size, tensor_model_parallel_size, pipeline_model_parallel_size,
                         context_parallel_size)
    tp, pp, cp = tensor_model_parallel_size, pipeline_model_parallel_size, context_parallel_size
    kwargs: Dict[str, Any] = {}
    for kind in ("tensor", "context", "data", "data_context", "pipeline", "model", "embedding"):
        mine = None
        for ranks in layout[kind]:
            group = dist.new_group(ranks, timeout=timeout)  # collective: every rank, every group
            if rank in ranks:
                mine = (group, ranks)
        kwargs[kind] = mine
    tp_ranks = kwargs["tensor"][1]
    dp_ranks = kwargs["data"][1]
    pp_ranks = kwargs["pipeline"][1]
    state = ParallelState(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        data_parallel_size=world_size // (tp * pp * cp),
        tensor_model_parallel_rank=tp_ranks.index(rank),
        pipeline_model_parallel_rank=pp_ranks.index(rank),
        data_parallel_rank=dp_ranks.index(rank),
        rank=rank,
        tensor_model_parallel_group=kwargs["tensor"][0],
        pipeline_model_parallel_group=kwargs["pipeline"][0],
        data_parallel_group=kwargs["data"][0],
        model_parallel_group=kwargs["model"][0],
        embedding_group=kwargs["embedding"][0] if kwargs["embedding"] else None,
        pipeline_ranks=list(pp_ranks),
        tensor_model_parallel_ranks=list(tp_ranks),
        data_parallel_ranks=list(dp_ranks),
        virtual_pipeline_model_parallel_size=virtual_pipeline_model_parallel_size,
        context_parallel_size=cp,
        context_parallel_rank=kwargs["context"][1].index(rank),
        context_parallel_group=kwargs["context"][0],
        context_parallel_ranks=list(kwargs["context"][1]),
        data_context_parallel_group=kwargs["data_context"][0],
        data_context_parallel_rank=kwargs["data_context"][1].index(rank),
        cp_comm_type=cp_comm_type,
    )
    if experts:
        _add_expert_groups(state, world_size, expert_model_parallel_size,
                           expert_tensor_parallel_size or tp, timeout)
    set_parallel_state(state)
    return state


def _add_expert_groups(state: ParallelState, world_size: int, ep: int, etp: int,
                       timeout: Optional[datetime.timedelta]) -> None:
    """Create the expert grid's groups (every rank, every group, one group per distinct rank
    list) and record this rank's in `state`."""
    layout = expert_rank_layout(world_size, state.tensor_model_parallel_size,
                                state.pipeline_model_parallel_size, state.context_parallel_size,
                                ep, etp)
    made: Dict[tuple, Any] = {}
    mine: Dict[str, Any] = {}
    for kind, groups in layout.items():
        for ranks in groups:
            key = tuple(ranks)
            if key not in made:  # collective: every rank creates every distinct group
                made[key] = dist.new_group(ranks, timeout=timeout)
            if state.rank in ranks:
                mine[kind] = (made[key], ranks)
    state.expert_model_parallel_size, state.expert_tensor_parallel_size = ep, etp
    state.expert_data_parallel_size = world_size // (etp * ep * state.pipeline_model_parallel_size)
    state.expert_model_parallel_group = mine["expert"][0]
    state.expert_model_parallel_rank = mine["expert"][1].index(state.rank)
    state.expert_tensor_parallel_group = mine["expert_tensor"][0]
    state.expert_tensor_parallel_rank = mine["expert_tensor"][1].index(state.rank)
    state.expert_data_parallel_group = mine["expert_data"][0]
    state.expert_data_parallel_rank = mine["expert_data"][1].index(state.rank)
    state.expert_tensor_and_expert_group = mine["expert_tensor_and_expert"][0]
    state.expert_model_group = mine["expert_model"][0]
    state.tensor_context_group = mine["tensor_context"][0]
    state.tensor_data_context_group = mine["tensor_data_context"][0]
