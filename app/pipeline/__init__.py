"""Pipeline parallelism: stage partitioning, point-to-point exchange, 1F1B schedule."""
from app.pipeline.partition import partition_layers, stage_layer_range
from app.pipeline.schedules import (forward_backward_no_pipelining,
                                    forward_backward_pipelining_1f1b, get_forward_backward_func)

__all__ = ["partition_layers", "stage_layer_range", "forward_backward_no_pipelining",
           "forward_backward_pipelining_1f1b", "get_forward_backward_func"]
