"""What a run reports: Megatron's FLOP formulas and the peaks behind MFU/HFU, timers, the log
line, TensorBoard/JSONL metrics and memory."""
