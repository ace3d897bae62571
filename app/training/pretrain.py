"""Build a whole run from parsed arguments and train it: the body of pretrain_gpt2.py.

Order: distributed start-up -> tokenizer (vocab size) -> RunConfig -> parallel groups and seeds
-> model stage -> engine -> checkpoint load -> datasets sized from the run -> Trainer.
"""
from __future__ import annotations

import sys
from typing import Any, Callable, List, Optional

import torch


def _print_rank0(rank: int) -> Callable[[str], None]:
    def log(msg: str) -> None:
        if rank == 0:
            print(msg, flush=True)
    return log


def set_seeds(seed: int, parallel_state: Any) -> None:
    """Python, numpy and torch seeds (seed + 100 x pipeline stage, as Megatron) and the
    model-parallel RNG stream (seed + 2718 + tensor-parallel rank)."""
    from app.mpu.random import model_parallel_seed
    model_parallel_seed(seed, parallel_state)


def build_parallel_state(cfg: Any, world_size: int) -> Any:
    from app.mpu.parallel_state import ParallelState, initialize_model_parallel
    p = cfg.parallel
    if cfg.deepspeed.enabled:  # DeepSpeed needs real groups, even in a world of one
        from app.training.deepspeed_engine import ensure_distributed
        ensure_distributed(p.distributed_backend)
    elif world_size == 1:
        return ParallelState.single()
    return initialize_model_parallel(p.tensor_model_parallel_size, p.pipeline_model_parallel_size)


def build_model(cfg: Any, parallel_state: Any) -> torch.nn.Module:
    """The GPT-2 stage this rank holds (all layers when there is one pipeline stage)."""
    from app.model import GPT2Model
    pp, stage = parallel_state.pipeline_model_parallel_size, parallel_state.pipeline_model_parallel_rank
    per_stage = cfg.model.num_layers // pp
    return GPT2Model(cfg.model, parallel_state, pre_process=stage == 0,
                     post_process=stage == pp - 1,
                     layer_range=(stage * per_stage, (stage + 1) * per_stage))


def _datasets(cfg: Any, parallel_state: Any, log: Callable[[str], None]) -> tuple:
    from app.data import build_train_valid_test_datasets
    from app.mpu import collectives
    from app.training.distributed import world_group
    t = cfg.training
    evals = (t.train_iters // t.eval_interval + 1) * t.eval_iters
    num_samples = (t.train_iters * t.global_batch_size, evals * t.global_batch_size,
                   t.eval_iters * t.global_batch_size)
    log(f"building train/valid/test datasets for {num_samples} samples from {cfg.data.data_path}")
    return build_train_valid_test_datasets(
        cfg.data.data_path, cfg.data.split, num_samples, cfg.model.seq_length, t.seed,
        cache_path=cfg.data.data_cache_path, vocab_size=cfg.raw_vocab_size,
        is_builder=parallel_state.rank == 0,
        barrier=lambda: collectives.barrier(world_group()))


def _load_on_all_ranks(engine: Any, load_dir: str, device: torch.device) -> Any:
    """engine.load_checkpoint on every rank, then agree: if any rank failed every rank raises,
    and every rank must have loaded the same iteration (none left waiting in a collective for
    a rank that exited, none starting at another iteration)."""
    from app.mpu import collectives
    from app.training.checkpoint import CheckpointError
    from app.training.distributed import world_group
    error: Optional[BaseException] = None
    loaded = None
    try:
        loaded = engine.load_checkpoint(load_dir)
    except Exception as exc:  # noqa: BLE001  re-raised below, after the other ranks know
        error = exc
    iteration = -1.0 if loaded is None else float(loaded.iteration)
    flags = torch.tensor([1.0 if error else 0.0, iteration, -iteration], device=device)
    collectives.all_reduce(flags, world_group(), op="max")  # NCCL needs a device tensor
    if error is not None:
        raise error
    if flags[0].item() > 0:
        raise CheckpointError(f"another rank could not load the checkpoint in {load_dir}; "
                              "its message says why")
    if flags[1].item() != -flags[2].item():
        raise CheckpointError(
            f"ranks loaded different iterations from {load_dir} (from {-flags[2].item():.0f} "
            f"to {flags[1].item():.0f}; -1 = none): is --load on a disk every node sees?")
    return loaded


def _explicit_flags(argv: Optional[List[str]]) -> set:
    given = sys.argv[1:] if argv is None else argv
    return {tok.split("=", 1)[0] for tok in given if tok.startswith("--")}


def pretrain(argv: Optional[List[str]] = None) -> Any:
    """Parse `argv`, build everything and train; returns the Trainer (for tests and tools)."""
    import arguments
    from app.data import build_tokenizer, pad_vocab_size
    from app.training.distributed import init_distributed
    from app.training.engine import build_engine
    from app.training.trainer import RunState, Trainer

    args = arguments.parse_args(argv)
    launch = arguments.launch_config(args)
    info = init_distributed(launch.distributed_backend, launch.deepspeed_mpi)
    log = _print_rank0(info.rank)
    log("------------------------ arguments ------------------------\n"
        + "\n".join(arguments.format_args(args))
        + "\n-------------------- end of arguments ---------------------")
    tokenizer = build_tokenizer(launch.tokenizer_type, launch.vocab_file, launch.merge_file)
    padded = pad_vocab_size(tokenizer.vocab_size, launch.make_vocab_size_divisible_by,
                            launch.tensor_model_parallel_size)
    log(f"> padded vocab (size: {tokenizer.vocab_size}) with {padded - tokenizer.vocab_size} "
        f"dummy tokens (new size: {padded})")
    cfg = arguments.build_run_config(args, info.world_size, tokenizer.vocab_size, padded)
    ps = build_parallel_state(cfg, info.world_size)
    set_seeds(cfg.training.seed, ps)
    if cfg.deepspeed.enabled and cfg.deepspeed.activation_checkpointing:
        from app.training.deepspeed_engine import configure_activation_checkpointing
        configure_activation_checkpointing(cfg, ps)
        log("activation checkpointing through deepspeed.checkpointing (settings from the JSON's "
            "activation_checkpointing block)")
    model = build_model(cfg, ps).to(info.device)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"> parameters on (tensor, pipeline) model-parallel rank "
        f"({ps.tensor_model_parallel_rank}, {ps.pipeline_model_parallel_rank}): {n_params}")
    engine = build_engine(cfg, model, ps, log=log, explicit_flags=_explicit_flags(argv))
    state = RunState()
    if cfg.checkpoint.load:
        loaded = _load_on_all_ranks(engine, cfg.checkpoint.load, info.device)
        if loaded is None:
            log(f"WARNING: --load {cfg.checkpoint.load} holds no checkpoint "
                "(no latest_checkpointed_iteration.txt); starting from iteration 0")
        else:
            state = RunState(loaded.iteration, loaded.consumed_train_samples,
                             loaded.consumed_valid_samples)
            log(f"loaded checkpoint {loaded.path}: resuming at iteration {loaded.iteration}, "
                f"consumed samples {loaded.consumed_train_samples}")
    datasets = _datasets(cfg, ps, log)
    trainer = Trainer(cfg, engine, ps, datasets, tokenizer.eod, info.device, log=print, state=state)
    trainer.train()
    return trainer


def main(argv: Optional[List[str]] = None) -> int:
    """Command-line entry: configuration, data and checkpoint errors exit 2 with one clear line
    (data format errors are ValueErrors); the process group is torn down either way."""
    from app.training.checkpoint import CheckpointError
    from app.training.distributed import shutdown_distributed
    try:
        pretrain(argv)
    except (ValueError, CheckpointError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        shutdown_distributed(graceful=False)
        return 2
    shutdown_distributed(graceful=True)
    return 0
