"""GPT-2 pretraining the Megatron-LM way, with a native path and a DeepSpeed path."""
