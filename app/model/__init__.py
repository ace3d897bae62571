"""GPT-2 model (Megatron-LM layout) and its fused-op wrappers."""
from app.model.gpt2 import GPT2Model, normal_init, param_seed

__all__ = ["GPT2Model", "normal_init", "param_seed"]
