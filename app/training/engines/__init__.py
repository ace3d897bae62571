"""The Engine interface the trainer drives, its native implementation (our mixed precision and
distributed optimizer) and its DeepSpeed implementation (the only importer of deepspeed), and the
DeepSpeed JSON reconciled with the flags."""
