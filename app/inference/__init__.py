"""Inference on our checkpoints: the model on TP x PP ranks (runner), KV cache, sampling, greedy
and beam generation, the tools' session, the Megatron-compatible server and zero-shot evaluation."""
