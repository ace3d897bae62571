"""Fused CUDA kernels from csrc/: built on first use for the local GPU, with PyTorch fallbacks.

- `build`: the cache of compiled libraries (keyed by torch, CUDA, arch and the sources), its
  lock, the timeout and the child process that compiles;
- `library`: this process's status (`status()`, `configure()`), logged once, and the
  agreement of all ranks on it (`agree_across_ranks()`);
- `ops`: autograd wrappers over the kernels and the shape rules for when they apply.
Model code never imports this package: it calls app/model/fused.py, which picks kernel or
PyTorch per op and says which in one start-up line.
"""
from app.kernels.library import Status, agree_across_ranks, available, configure, status

__all__ = ["Status", "agree_across_ranks", "available", "configure", "status"]
