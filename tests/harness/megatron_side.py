"""Megatron-LM's side of the checkpoint interoperability checks, on CPU with Megatron Core's own
code: the installed megatron-core (requirements-test.txt), or a Megatron-LM checkout first on
PYTHONPATH (MEGATRON_LM in test_megatron_interop.py).

    python megatron_side.py read DIR [DIR...]
                                             for each DIR: build GPTModel (local spec) from the
                                             args in DIR's common state, load the latest
                                             iteration with dist_checkpointing.load, and compare
                                             its logits on DIR/probe.pt's tokens with the
                                             logits stored there
    python megatron_side.py write FORMAT MODEL=DIR [MODEL=DIR...] [SPLIT DATA_PATH...]
                                             for each MODEL (gpt2; llama: SwiGLU, RMSNorm,
                                             QKV biases only, QK-norm, RoPE with Llama 3.1's
                                             scaling, 2 query groups, untied; moe: llama with
                                             4 experts, top-2, in every layer)
                                             build a GPTModel from the args Megatron-LM's own
                                             parse_args made (tests/data/megatron_args,
                                             core_v0.16.1; llama: the swiglu_rmsnorm flags with
                                             LLAMA on top; moe: the qwen3_moe flags with LLAMA
                                             on top), save it at iteration 3 into DIR as
                                             Megatron-LM's save_checkpoint does in FORMAT
                                             (torch_dist: dist_checkpointing.save with the common
                                             state, rng_state object and tracker; torch: the legacy
                                             mp_rank_00/model_optim_rng.pt with the model's
                                             state_dict_for_save_checkpoint) and store its logits
                                             on fixed tokens in DIR/probe.pt; with SPLIT and
                                             DATA_PATH (Megatron's --split, --data-path), also
                                             the first DIR's losses of the global batches after
                                             iteration 3
                                             up to --train-iters, on Megatron's datasets, in
                                             DIR/megatron_losses.json
    python megatron_side.py COMMAND ARGS + COMMAND ARGS ...
                                             several commands, one after the other, in one
                                             process (one import of Megatron Core)

The model is built as Megatron-LM's core_transformer_config_from_args builds it from those args
(num_query_groups only under group_query_attention, every moe_* field, num_moe_experts from
num_experts, ...), with the decoder block spec of gpt_builders when it has experts (local spec,
SequentialMLP experts, the allgather dispatcher: the one that runs on CPU). Only Megatron's own
modules build, save and load. Four CUDA-only calls of Megatron Core get CPU stand-ins (core
attention's scratch buffer, the RNG tracker fork around dropout 0, the writer's
torch.cuda.synchronize/current_device, and 0.16.1's router GEMM test of Transformer Engine's
te_general_gemm, a name it binds only when Transformer Engine imports); its arithmetic is
untouched.
"""
import contextlib
import json
import os
import random
import sys

import numpy
import torch
import torch.distributed as dist
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.append(ROOT)  # tests.harness (after Megatron, which may come from a checkout)
ITERATION, CONSUMED = 3, 12
"""Where `write` saves: iteration 3 of a run with global batch 4."""
LLAMA = dict(qk_layernorm=True, position_embedding_type="rope", group_query_attention=True,
             num_query_groups=2, untie_embeddings_and_output_weights=True, add_qkv_bias=True,
             use_rope_scaling=True, rotary_base=1000000)
"""What the llama model sets on top of Megatron's swiglu_rmsnorm args (--swiglu --normalization
RMSNorm --disable-bias-linear): QK-norm, RoPE with Llama 3.1's scaling (Megatron's GPT builder:
factor 8) at base 1e6, QKV biases (--add-qkv-bias), 2 query groups, untied output layer."""

torch.cuda.synchronize = lambda *a, **k: None
torch.cuda.current_device = lambda: "cpu"


def setup():
    """One gloo process group of one rank and Megatron's model-parallel state, with the CPU
    stand-ins; once per process (every command of a `+` list shares it)."""
    from megatron.core import parallel_state, tensor_parallel
    if dist.is_initialized():
        return parallel_state
    import megatron.core.transformer.moe.moe_utils as moe_utils
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None  # 0.16.1 names it only when Transformer Engine imports
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    dist.init_process_group("gloo", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    parallel_state.get_global_memory_buffer().get_tensor = (
        lambda shape, dtype, name, mem_alloc_context=None: torch.empty(shape, dtype=dtype))
    tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    return parallel_state


def moe_fields(args):
    """The MoE part of Megatron-LM's core_transformer_config_from_args: every moe_* field of
    TransformerConfig that `args` has, num_moe_experts from num_experts; on this one CPU
    process the allgather dispatcher and the per-expert (SequentialMLP) experts."""
    import dataclasses
    from megatron.core.transformer.transformer_config import TransformerConfig
    if not getattr(args, "num_experts", None):
        return {}
    fields = {f.name: getattr(args, f.name) for f in dataclasses.fields(TransformerConfig)
              if f.name.startswith("moe_") and hasattr(args, f.name)}
    return dict(fields, num_moe_experts=args.num_experts, moe_token_dispatcher_type="allgather",
                moe_grouped_gemm=False)


def build(args):
    """Megatron Core's GPTModel (local spec) for `args`, configured the way Megatron-LM's
    core_transformer_config_from_args and gpt_builders configure it."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (get_gpt_decoder_block_spec,
                                                          get_gpt_layer_local_spec)
    from megatron.core.transformer.transformer_config import TransformerConfig
    assert not args.openai_gelu and not args.squared_relu, "only GeLU and SwiGLU here"
    assert not args.layernorm_zero_centered_gamma, "no zero-centred norms without apex / TE"
    activation = F.silu if args.swiglu else F.gelu
    cfg = TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads, ffn_hidden_size=args.ffn_hidden_size,
        kv_channels=args.kv_channels,
        num_query_groups=args.num_query_groups if args.group_query_attention else None,
        layernorm_epsilon=args.layernorm_epsilon, hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout, add_bias_linear=args.add_bias_linear,
        add_qkv_bias=args.add_qkv_bias,
        gated_linear_unit=args.swiglu, activation_func=activation,
        normalization=args.normalization, qk_layernorm=args.qk_layernorm,
        attention_softmax_in_fp32=args.attention_softmax_in_fp32,
        use_cpu_initialization=True, bias_activation_fusion=False, bias_dropout_fusion=False,
        masked_softmax_fusion=False, persist_layer_norm=False,
        gradient_accumulation_fusion=False, params_dtype=args.params_dtype,
        pipeline_dtype=args.params_dtype, init_method_std=args.init_method_std,
        **moe_fields(args))
    if cfg.num_moe_experts:  # gpt_builders: the block spec places MoE layers by moe_layer_freq
        spec = get_gpt_decoder_block_spec(cfg, use_transformer_engine=False,
                                          normalization=args.normalization)
    else:
        spec = get_gpt_layer_local_spec(normalization=args.normalization,
                                        qk_layernorm=args.qk_layernorm)
    return GPTModel(cfg, spec, vocab_size=args.padded_vocab_size,
                    max_sequence_length=args.max_position_embeddings,
                    share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                    position_embedding_type=args.position_embedding_type,
                    rotary_percent=args.rotary_percent, rotary_base=args.rotary_base,
                    rope_scaling=args.use_rope_scaling)  # the factor: its default, as Megatron's


def megatron_args(flag_set, **overrides):
    """The args Megatron-LM's parse_args + validate_args made for `flag_set` (core_v0.16.1),
    with Megatron's enums, and what training sets before a save (`overrides`)."""
    from tests.harness import megatron_args as fixtures
    return fixtures.load("core_v0.16.1", flag_set, enums=True, **overrides)


def logits(model, tokens):
    seq = tokens.shape[1]
    position = torch.arange(seq).unsqueeze(0).expand_as(tokens)
    mask = torch.triu(torch.ones(1, 1, seq, seq, dtype=torch.bool), 1)
    model.eval()
    with torch.no_grad():
        return model(tokens, position, mask)


def read(*directories):
    parallel_state = setup()
    return max(read_one(directory, parallel_state) for directory in directories)


def read_one(directory, parallel_state):
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
    return 0 if diff < 1e-5 else 1


class _GPT2Tokenizer:
    """What Megatron's GPTDataset asks of Megatron-LM's _GPT2BPETokenizer (not in the
    megatron-core wheel): its vocabulary size, eod id and unique_identifiers (which name the
    cache files); `pad` raises as Megatron's does."""

    def __init__(self, vocab_file, merge_file):
        with open(vocab_file) as f:
            vocab = json.load(f)
        self.vocab_size, self.eod = len(vocab), vocab["<|endoftext|>"]
        self.unique_identifiers = {"class": "_GPT2BPETokenizer",
                                   "tokenizer_path": [vocab_file, merge_file]}

    @property
    def pad(self):
        raise NotImplementedError("GPT2BPETokenizer has no pad token")


def train_dataset(args):
    """Megatron's training dataset for `args`: BlendedMegatronDatasetBuilder + GPTDataset with
    the config pretrain_gpt.py's core_gpt_dataset_config_from_args builds, for the sample counts
    of training.py's get_train_valid_test_num_samples."""
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder)
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    from megatron.core.datasets.utils import get_blend_from_list
    config = GPTDatasetConfig(
        random_seed=args.seed, sequence_length=args.seq_length,
        blend=get_blend_from_list(args.data_path), blend_per_split=None, split=args.split,
        multiple_validation_sets=args.multiple_validation_sets,
        full_validation=args.full_validation,
        num_dataset_builder_threads=args.num_dataset_builder_threads,
        path_to_cache=args.data_cache_path, mmap_bin_files=args.mmap_bin_files,
        tokenizer=_GPT2Tokenizer(args.vocab_file, args.merge_file),
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask, eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=args.create_attention_mask_in_dataloader,
        object_storage_cache_path=args.object_storage_cache_path,
        mid_level_dataset_surplus=args.mid_level_dataset_surplus,
        allow_ambiguous_pad_tokens=args.allow_ambiguous_pad_tokens,
        fast_cache_load=args.dataloader_fast_cache_load, sequences_per_dataset=None,
        defer_npy_index_mmap=args.dataloader_defer_npy_index_mmap,
        context_parallel_size=args.context_parallel_size,
        data_parallel_size=args.data_parallel_size,
        sequence_parallel_size=args.tensor_model_parallel_size * args.sequence_parallel,
        hybrid_context_parallel=args.hybrid_context_parallel)
    eval_iters = (args.train_iters // args.eval_interval + 1) * args.eval_iters
    counts = [args.train_iters * args.global_batch_size, eval_iters * args.global_batch_size,
              args.eval_iters * args.global_batch_size]
    return BlendedMegatronDatasetBuilder(GPTDataset, counts, lambda: True, config).build()[0]


def next_losses(model, args, first_iteration, last_iteration):
    """{iteration: Megatron's "lm loss"} of the global batches after the checkpoint: iteration
    i takes samples [(i-1) * gbs, i * gbs) (the single sampler); per-token losses from
    GPTModel's forward with labels, averaged over the loss mask as pretrain_gpt.py's loss_func
    and training_log do (sum of masked losses / sum of the mask over the global batch)."""
    dataset = train_dataset(args)
    gbs, out = args.global_batch_size, {}
    model.eval()
    for iteration in range(first_iteration, last_iteration + 1):
        samples = [dataset[i] for i in range((iteration - 1) * gbs, iteration * gbs)]
        batch = {k: torch.stack([torch.as_tensor(s[k]) for s in samples])
                 for k in ("tokens", "labels", "loss_mask", "position_ids")}
        mask = torch.stack([s["attention_mask"] for s in samples])  # [b, 1, s, s] True: masked
        with torch.no_grad():
            losses = model(batch["tokens"], batch["position_ids"], mask,
                           labels=batch["labels"])  # [b, s]
        loss_mask = batch["loss_mask"].view(-1).float()
        out[str(iteration)] = float((losses.view(-1).float() * loss_mask).sum() / loss_mask.sum())
    return out


def _rng_state():
    """Megatron's per-rank RNG record (get_rng_state) as a CPU run has it: no CUDA state."""
    from megatron.core import tensor_parallel
    return [{"random_rng_state": random.getstate(), "np_rng_state": numpy.random.get_state(),
             "torch_rng_state": torch.get_rng_state(),
             "rng_tracker_states": tensor_parallel.get_cuda_rng_tracker().get_states()}]


def write(ckpt_format, *rest):
    parallel_state = setup()
    models = [arg.split("=", 1) for arg in rest if "=" in arg]
    split, *data_path = [arg for arg in rest if "=" not in arg] or [None]
    for i, (name, directory) in enumerate(models):
        write_one(directory, ckpt_format, name, parallel_state, split if i == 0 else None,
                  data_path if i == 0 else [])
    return 0


def write_one(directory, ckpt_format, name, parallel_state, split, data_path):
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.enums import ModelType
    torch.manual_seed(5)
    flag_set = {"gpt2": "gpt2" if ckpt_format == "torch_dist" else "gpt2_legacy",
                "llama": "swiglu_rmsnorm", "moe": "qwen3_moe"}[name]
    model_flags = dict(LLAMA, ckpt_format=ckpt_format) if name != "gpt2" else {}
    args = megatron_args(flag_set, consumed_train_samples=ITERATION * 4, iteration=ITERATION,
                         curr_iteration=ITERATION, model_type=ModelType.encoder_or_decoder,
                         **model_flags)
    assert args.ckpt_format == ckpt_format
    model = build(args)
    with torch.no_grad():  # LayerNorms and biases away from 1 and 0, so a swapped key shows;
        for key, param in model.named_parameters():  # routers decisive, so a swapped expert shows
            if "norm" in key or key.endswith("bias"):
                param.add_(0.1 * torch.randn_like(param))
            if key.endswith("router.weight"):
                param.normal_(0.0, 1.0)
    state = {"args": args, "checkpoint_version": 3.0, "iteration": ITERATION,
             "num_floating_point_operations_so_far": 0}
    ckpt = os.path.join(directory, f"iter_{ITERATION:07d}")
    if ckpt_format == "torch_dist":
        metadata = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
        state["model"] = model.sharded_state_dict(metadata=dict(
            metadata, dp_cp_group=parallel_state.get_data_parallel_group(
                with_context_parallel=True)))
        state["rng_state"] = ShardedObject("rng_state", _rng_state(), (1, 1), (0, 0),
                                           replica_id=0)
        os.makedirs(ckpt)
        dist_checkpointing.save(state, ckpt, content_metadata=metadata)
    else:  # megatron/training/checkpointing.py: generate_state_dict for ckpt_format torch
        state["model"] = model.state_dict_for_save_checkpoint()
        state["rng_state"] = _rng_state()
        os.makedirs(os.path.join(ckpt, "mp_rank_00"))
        torch.save(state, os.path.join(ckpt, "mp_rank_00", "model_optim_rng.pt"))
    with open(os.path.join(directory, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write(str(ITERATION))
    tokens = torch.randint(0, args.padded_vocab_size, (2, args.seq_length),
                           generator=torch.Generator().manual_seed(1))
    torch.save({"tokens": tokens, "logits": logits(model, tokens)},
               os.path.join(directory, "probe.pt"))
    if data_path:  # the losses of the next global batches, with Megatron's data and loss
        args = megatron_args(flag_set, data_path=list(data_path), split=split, eval_iters=0,
                             eval_interval=1000, data_cache_path=os.path.join(directory, "cache"),
                             **model_flags)
        losses = next_losses(model, args, ITERATION + 1, args.train_iters)
        with open(os.path.join(directory, "megatron_losses.json"), "w") as f:
            json.dump(losses, f)
        print(f"megatron losses of iterations {sorted(losses)}: {losses}")
    print(f"megatron wrote {name} as {ckpt_format}: {sorted(os.listdir(ckpt))}")


def main(argv):
    """Each command of `argv` (commands separated by a lone `+`) in turn, in this one process
    (Megatron Core is imported once); the first non-zero result, else 0."""
    commands, current = [], []
    for arg in argv + ["+"]:
        if arg == "+":
            commands.append(current)
            current = []
        else:
            current.append(arg)
    results = [{"read": read, "write": write}[name](*rest) for name, *rest in commands]
    return next((r for r in results if r), 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
