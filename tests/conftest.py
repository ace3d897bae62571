"""Shared pytest setup: one torch thread per test process (the suite runs on 2 cores)."""
import torch

torch.set_num_threads(1)
