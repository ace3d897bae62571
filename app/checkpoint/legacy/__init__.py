"""Megatron-LM's legacy checkpoint format (`--ckpt-format torch`, the registry's `torch`; the
converter's alias `megatron`): `per_rank` is each rank's `model_optim_rng.pt` (Megatron's dict,
its crash-safe writer and safe reader: training and inference at the saved layout), `whole` the
whole model read and written at any TP x PP (conversion, and inference at another layout)."""
