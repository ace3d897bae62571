"""Megatron Core's vocabulary, shared by both Megatron formats: `names` maps our parameter names
to Megatron Core's keys (torch_dist's keys, and a Megatron Core model saved in the legacy
format), `state` is Megatron-LM's common state (args, checkpoint_version and its check, the
optimizer's non-tensor part, the LR schedule)."""
