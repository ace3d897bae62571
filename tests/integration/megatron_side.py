"""Megatron-LM's side of the torch_dist interoperability check: run with a Python that imports
Megatron Core from a Megatron-LM checkout (PYTHONPATH=<checkout>), on CPU.

    python megatron_side.py read  DIR   build GPTModel (local spec) from the args in DIR's common
                                        state, load the latest iteration with
                                        dist_checkpointing.load, and compare its logits on
                                        DIR/probe.pt's tokens with the logits stored there
    python megatron_side.py write DIR   build a GPTModel, save it as Megatron-LM's save_checkpoint
                                        does (common state, rng_state object, tracker) and store
                                        its logits on fixed tokens in DIR/probe.pt

Only Megatron's own modules build, save and load. Three CUDA-only calls of Megatron Core get
CPU stand-ins (core attention's scratch buffer, the RNG tracker fork around dropout 0, and the
writer's torch.cuda.synchronize/current_device); its arithmetic is untouched.
"""
import argparse
import contextlib
import os
import random
import sys

import numpy
import torch
import torch.distributed as dist
import torch.nn.functional as F

torch.cuda.synchronize = lambda *a, **k: None
torch.cuda.current_device = lambda: "cpu"


def setup():
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    dist.init_process_group("gloo", rank=0, world_size=1)
    from megatron.core import parallel_state, tensor_parallel
    parallel_state.initialize_model_parallel(1, 1)
    parallel_state.get_global_memory_buffer().get_tensor = (
        lambda shape, dtype, name, mem_alloc_context=None: torch.empty(shape, dtype=dtype))
    tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    return parallel_state


def build(args):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig
    cfg = TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads, ffn_hidden_size=args.ffn_hidden_size,
        num_query_groups=args.num_query_groups, layernorm_epsilon=1e-5, hidden_dropout=0.0,
        attention_dropout=0.0, add_bias_linear=True, gated_linear_unit=False,
        activation_func=F.gelu, normalization="LayerNorm", attention_softmax_in_fp32=True,
        use_cpu_initialization=True, bias_activation_fusion=False, bias_dropout_fusion=False,
        masked_softmax_fusion=False, persist_layer_norm=False,
        gradient_accumulation_fusion=False, params_dtype=torch.float32,
        pipeline_dtype=torch.float32, init_method_std=0.05)
    return GPTModel(cfg, get_gpt_layer_local_spec(), vocab_size=args.padded_vocab_size,
                    max_sequence_length=args.max_position_embeddings,
                    share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                    position_embedding_type="learned_absolute")


def logits(model, tokens):
    seq = tokens.shape[1]
    position = torch.arange(seq).unsqueeze(0).expand_as(tokens)
    mask = torch.triu(torch.ones(1, 1, seq, seq, dtype=torch.bool), 1)
    model.eval()
    with torch.no_grad():
        return model(tokens, position, mask)


def read(directory):
    parallel_state = setup()
    from megatron.core import dist_checkpointing
    iteration = open(os.path.join(directory, "latest_checkpointed_iteration.txt")).read().strip()
    ckpt = os.path.join(directory, f"iter_{int(iteration):07d}")
    common = dist_checkpointing.load_common_state_dict(ckpt)
    model = build(common["args"])
    metadata = dict(common.get("content_metadata") or {})
    metadata["dp_cp_group"] = parallel_state.get_data_parallel_group(with_context_parallel=True)
    sharded = model.sharded_state_dict(metadata=metadata)
    state = dist_checkpointing.load({"model": sharded}, ckpt, strict="raise_unexpected")
    result = model.load_state_dict(state["model"], strict=True)
    probe = torch.load(os.path.join(directory, "probe.pt"))
    diff = (logits(model, probe["tokens"]) - probe["logits"]).abs().max().item()
    print(f"megatron read {len(sharded)} sharded entries from {ckpt}; load_state_dict: {result}; "
          f"max |logits - ours| = {diff:.3g}")
    return 0 if diff < 1e-4 else 1


def write(directory):
    parallel_state = setup()
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.enums import ModelType
    torch.manual_seed(5)
    layers, hidden, heads, vocab, seq = 2, 32, 4, 64, 16
    args = argparse.Namespace(  # Megatron-LM's names (megatron/training/arguments.py)
        num_layers=layers, hidden_size=hidden, num_attention_heads=heads, ffn_hidden_size=4 * hidden,
        kv_channels=hidden // heads, seq_length=seq, max_position_embeddings=seq,
        padded_vocab_size=vocab, vocab_size=vocab, tokenizer_type="GPT2BPETokenizer",
        group_query_attention=False, num_query_groups=heads,
        position_embedding_type="learned_absolute", untie_embeddings_and_output_weights=False,
        layernorm_epsilon=1e-5, normalization="LayerNorm", swiglu=False, add_bias_linear=True,
        tensor_model_parallel_size=1, pipeline_model_parallel_size=1, data_parallel_size=1,
        world_size=1, params_dtype=torch.float32, model_type=ModelType.encoder_or_decoder,
        consumed_train_samples=80, consumed_valid_samples=0, iteration=5, ckpt_format="torch_dist",
        no_save_optim=True, no_save_rng=False)
    model = build(args)
    with torch.no_grad():  # LayerNorms and biases away from 1 and 0, so a swapped key shows
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                param.add_(0.1 * torch.randn_like(param))
    metadata = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
    rng = [{"random_rng_state": random.getstate(), "np_rng_state": numpy.random.get_state(),
            "torch_rng_state": torch.get_rng_state(), "rng_tracker_states": {}}]
    sharded = model.sharded_state_dict(metadata=dict(
        metadata, dp_cp_group=parallel_state.get_data_parallel_group(with_context_parallel=True)))
    state = {"args": args, "checkpoint_version": 3.0, "iteration": 5, "model": sharded,
             "rng_state": ShardedObject("rng_state", rng, (1, 1), (0, 0), replica_id=0),
             "num_floating_point_operations_so_far": 0}
    ckpt = os.path.join(directory, "iter_0000005")
    os.makedirs(ckpt)
    dist_checkpointing.save(state, ckpt, content_metadata=metadata)
    with open(os.path.join(directory, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("5")
    tokens = torch.randint(0, vocab, (2, seq), generator=torch.Generator().manual_seed(1))
    torch.save({"tokens": tokens, "logits": logits(model, tokens)},
               os.path.join(directory, "probe.pt"))
    print(f"megatron wrote {sorted(os.listdir(ckpt))}")
    return 0


if __name__ == "__main__":
    sys.exit({"read": read, "write": write}[sys.argv[1]](sys.argv[2]))
