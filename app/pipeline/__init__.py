"""Pipeline parallelism: stage partitioning, point-to-point exchange, 1F1B schedules (plain and
interleaved over model chunks)."""
from app.pipeline.chunks import ModelChunks
from app.pipeline.partition import (partition_layers, stage_layer_range, stage_of_layer,
                                    virtual_stage_layer_ranges)
from app.pipeline.schedules import (forward_backward_no_pipelining,
                                    forward_backward_pipelining_1f1b,
                                    forward_backward_pipelining_interleaved,
                                    get_forward_backward_func)

__all__ = ["ModelChunks", "partition_layers", "stage_layer_range", "stage_of_layer",
           "virtual_stage_layer_ranges",
           "forward_backward_no_pipelining", "forward_backward_pipelining_1f1b",
           "forward_backward_pipelining_interleaved", "get_forward_backward_func"]
