"""GPT-2 model (Megatron-LM layout), its fused-op wrappers, and the one builder of a model
stage with the records of its parameters (app.model.stage)."""
from app.model.gpt2 import GPT2Model, normal_init, param_seed

__all__ = ["GPT2Model", "normal_init", "param_seed"]
