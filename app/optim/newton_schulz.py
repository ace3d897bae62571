"""Newton-Schulz orthogonalisation, Muon's update scale and the fused-QKV split (pure arithmetic).

Muon replaces a matrix's momentum M [m, n] by an approximation of U V^T, where M = U S V^T is
its singular value decomposition: every singular value is pushed towards 1 by a few iterations
of an odd polynomial, with X_0 = M / ||M||_F (so that every singular value is at most 1):

    A = X X^T                   # [m, m]  (X transposed first when m > n: the Gram is min(m, n)^2)
    X <- a X + (b A + c A^2) X  # one step with coefficients (a, b, c)

The coefficient schedules are those of Megatron-LM (through NVIDIA's emerging-optimizers):
`simple` is Keller Jordan's single tuple (also torch.optim.Muon's and DeepSpeed's), `quintic`
five tuned tuples cycled (Megatron's default), `polar_express` the Polar Express schedule
(Amsel et al. 2025) whose last tuple repeats. These iterations are tuned for speed, not
convergence: the singular values land near 1 (roughly within [0.7, 1.2]), not on it.

With the matrix split over tensor-parallel ranks along its long side, the iteration runs
distributed (`Gram` = an all-reduce of each rank's X_i X_i^T, the rest local); the hooks here
take that reduction as a function, so this module stays free of process groups.

The update is then scaled (`scale_factor`) by one of Megatron's modes, for an m x n matrix
(m = output rows, n = input columns): spectral sqrt(max(m, n)), unit_rms_norm sqrt(m / n),
shape_scaling sqrt(max(1, m / n)); times --muon-extra-scale-factor.
"""
from __future__ import annotations

import contextlib
import itertools
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

Coefficients = Tuple[float, float, float]

COEFFICIENT_SETS: Dict[str, List[Coefficients]] = {
    "simple": [(3.4445, -4.7750, 2.0315)],
    "quintic": [(4.0848, -6.8946, 2.9270), (3.9505, -6.3029, 2.6377),
                (3.7418, -5.5913, 2.3037), (2.8769, -3.1427, 1.2046),
                (2.8366, -3.0525, 1.2012)],
    "polar_express": [(8.2051, -22.9019, 16.4607), (4.0664, -2.8612, 0.5184),
                      (3.9096, -2.8234, 0.5250), (3.2856, -2.4153, 0.4853),
                      (2.2779, -1.6198, 0.3985), (1.8726, -1.2307, 0.3585),
                      (1.8564, -1.2132, 0.3568), (1.8750, -1.2500, 0.3750)],
}
"""(a, b, c) per Newton-Schulz step; `simple` and `quintic` cycle, `polar_express` repeats its
last tuple once its list is used up."""
COEFFICIENT_TYPES = tuple(COEFFICIENT_SETS)
SCALE_MODES = ("spectral", "unit_rms_norm", "shape_scaling")
MATMUL_PRECISIONS = ("low", "medium", "high")
"""--muon-fp32-matmul-prec: medium runs the iteration in bf16; high in fp32 with torch's "high"
matmul precision (TF32 on CUDA tensor cores, exact fp32 on the CPU); low in fp32 at the
process's matmul precision (exact fp32 by default), since torch ignores "low" as Megatron
passes it."""
_REPEAT_LAST = ("polar_express",)
_EPS = 1e-15

Reduce = Callable[[torch.Tensor], torch.Tensor]
"""Sums a tensor over the tensor-parallel ranks that hold parts of one matrix (in place)."""


def coefficient_schedule(coefficient_type: str, steps: int) -> Iterator[Coefficients]:
    """The `steps` (a, b, c) tuples of `coefficient_type` (see COEFFICIENT_SETS)."""
    if coefficient_type not in COEFFICIENT_SETS:
        raise ValueError(f"--muon-coefficient-type must be one of {', '.join(COEFFICIENT_TYPES)}, "
                         f"got {coefficient_type!r}")
    sets = COEFFICIENT_SETS[coefficient_type]
    base = (itertools.chain(sets, itertools.repeat(sets[-1])) if coefficient_type in _REPEAT_LAST
            else itertools.cycle(sets))
    return itertools.islice(base, steps)


@contextlib.contextmanager
def _matmul_precision(precision: str) -> Iterator[None]:
    """torch's fp32 matmul precision set to "high" for `high`, left alone otherwise."""
    if precision != "high":
        yield
        return
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


def newton_schulz(matrix: torch.Tensor, steps: int, coefficient_type: str = "quintic",
                  precision: str = "high", transpose: Optional[bool] = None,
                  reduce: Optional[Reduce] = None) -> torch.Tensor:
    """Approximately U V^T of `matrix` [m, n] (fp32 in, fp32 out) by `steps` Newton-Schulz steps.

    `transpose` None iterates on the matrix or its transpose, whichever has fewer rows (the
    Gram matrix is then min(m, n)^2); True / False force it. `precision` is
    --muon-fp32-matmul-prec (MATMUL_PRECISIONS). `reduce`, for a matrix split over ranks along
    the iterated matrix's columns (the dimension the Gram matrix sums over), sums the squared
    Frobenius norm and every Gram matrix over those ranks; each rank then gets its own columns
    of the result.
    """
    if matrix.dim() != 2:
        raise ValueError(f"Newton-Schulz needs a 2-D matrix, got shape {tuple(matrix.shape)}")
    if precision not in MATMUL_PRECISIONS:
        raise ValueError(f"--muon-fp32-matmul-prec must be one of {', '.join(MATMUL_PRECISIONS)}, "
                         f"got {precision!r}")
    if transpose is None:
        transpose = matrix.shape[0] > matrix.shape[1]
    x = matrix.float()
    x = x.mT if transpose else x  # [r, k]: the Gram matrix is r x r
    squared = x.square().sum()
    if reduce is not None:
        squared = reduce(squared)
    x = x / squared.sqrt().clamp_min(_EPS)
    if precision == "medium":
        x = x.to(torch.bfloat16)
    with _matmul_precision(precision):
        for a, b, c in coefficient_schedule(coefficient_type, steps):
            gram = x @ x.mT  # [r, r]
            if reduce is not None:
                gram = reduce(gram.float()).to(x.dtype)
            poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)  # b A + c A^2
            x = torch.addmm(x, poly, x, beta=a, alpha=1.0)  # a X + (b A + c A^2) X
    x = x.float()
    return x.mT if transpose else x


def scale_factor(rows: int, cols: int, mode: str = "spectral", extra: float = 1.0) -> float:
    """Muon's update scale for a `rows` x `cols` (output x input) matrix, times `extra`."""
    if mode == "spectral":
        base = max(rows, cols) ** 0.5
    elif mode == "unit_rms_norm":
        base = (rows / cols) ** 0.5
    elif mode == "shape_scaling":
        base = max(1.0, rows / cols) ** 0.5
    else:
        raise ValueError(f"--muon-scale-mode must be one of {', '.join(SCALE_MODES)}, "
                         f"got {mode!r}")
    return base * extra


def split_qkv_rows(matrix: torch.Tensor, groups: int, queries_per_group: int,
                   head_dim: int) -> List[torch.Tensor]:
    """The fused QKV weight [groups x (q heads, k, v) x head_dim, n] (docs/architecture.md)
    as three matrices: queries [groups x q heads x head_dim, n], keys and values
    [groups x head_dim, n] each, rows in group order."""
    cols = matrix.shape[1]
    per_group = (queries_per_group + 2) * head_dim
    if matrix.shape[0] != groups * per_group:
        raise ValueError(f"QKV weight has {matrix.shape[0]} rows, expected {groups} groups x "
                         f"({queries_per_group} + 2) heads x {head_dim}")
    view = matrix.reshape(groups, per_group, cols)
    q, k, v = view.split([queries_per_group * head_dim, head_dim, head_dim], dim=1)
    return [part.reshape(-1, cols) for part in (q, k, v)]


def join_qkv_rows(parts: Sequence[torch.Tensor], groups: int) -> torch.Tensor:
    """Inverse of `split_qkv_rows`: queries, keys and values back into the fused row order."""
    cols = parts[0].shape[1]
    return torch.cat([p.reshape(groups, -1, cols) for p in parts], dim=1).reshape(-1, cols)
