"""Model-parallel unit: parallel state, collectives, mappings, tensor-parallel layers,
vocab-parallel cross-entropy, RNG tracker with activation checkpointing, gradient reductions.

See docs/architecture.md ("app.mpu") for the contract and docs/parallelism.md for the design.
"""
from app.mpu import collectives
from app.mpu.cross_entropy import vocab_parallel_cross_entropy
from app.mpu.grads import (allreduce_embedding_grads, allreduce_gradients, clip_grad_norm,
                           grad_norm)
from app.mpu.layers import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                            set_tensor_model_parallel_attributes)
from app.mpu.mappings import (copy_to_tensor_model_parallel_region,
                              gather_from_tensor_model_parallel_region,
                              reduce_from_tensor_model_parallel_region,
                              scatter_to_tensor_model_parallel_region)
from app.mpu.parallel_state import (ParallelState, destroy_model_parallel, expert_rank_layout,
                                    get_parallel_state, initialize_model_parallel, rank_layout,
                                    set_parallel_state)
from app.mpu.random import (RNGStatesTracker, checkpoint, get_rng_tracker,
                            load_rng_state_dict, model_parallel_seed, rng_state_dict,
                            set_checkpoint_implementation)
from app.mpu.utils import divide, vocab_range

__all__ = [
    "collectives", "vocab_parallel_cross_entropy", "allreduce_embedding_grads",
    "allreduce_gradients", "clip_grad_norm", "grad_norm", "ColumnParallelLinear",
    "RowParallelLinear", "VocabParallelEmbedding", "set_tensor_model_parallel_attributes",
    "copy_to_tensor_model_parallel_region", "gather_from_tensor_model_parallel_region",
    "reduce_from_tensor_model_parallel_region", "scatter_to_tensor_model_parallel_region",
    "ParallelState", "destroy_model_parallel", "get_parallel_state", "initialize_model_parallel",
    "expert_rank_layout", "rank_layout", "set_parallel_state", "RNGStatesTracker", "checkpoint", "get_rng_tracker",
    "load_rng_state_dict", "model_parallel_seed", "rng_state_dict",
    "set_checkpoint_implementation", "divide", "vocab_range",
]
