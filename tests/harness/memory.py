"""A model configured from a short command line, its stages built at any TP/PP rank, and the
bytes autograd saves in one forward: what the memory-estimate tests measure against."""
import torch

import arguments
from app.model import GPT2Model
from app.mpu.parallel_state import ParallelState
from app.mpu.random import model_parallel_seed


BASE = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "64", "--micro-batch-size", "4", "--train-iters", "2",
        "--make-vocab-size-divisible-by", "64", "--distributed-backend", "gloo"]


def config(*extra, world=1, vocab=500):
    return arguments.config_from_argv([*BASE, *extra], world, vocab)


def stage_model(cfg, tp_rank=0, pp_rank=0, ep_rank=0, etp_rank=0):
    p = cfg.parallel
    ps = ParallelState(tensor_model_parallel_size=p.tensor_model_parallel_size,
                       pipeline_model_parallel_size=p.pipeline_model_parallel_size,
                       tensor_model_parallel_rank=tp_rank, pipeline_model_parallel_rank=pp_rank,
                       context_parallel_size=p.context_parallel_size,
                       context_parallel_ranks=list(range(p.context_parallel_size)),
                       cp_comm_type=p.cp_comm_type,
                       expert_model_parallel_size=p.expert_model_parallel_size,
                       expert_model_parallel_rank=ep_rank,
                       expert_tensor_parallel_size=p.expert_tensor_parallel_size,
                       expert_tensor_parallel_rank=etp_rank)
    pp = p.pipeline_model_parallel_size
    per = cfg.model.num_layers // pp
    model_parallel_seed(1, ParallelState.single())
    return GPT2Model(cfg.model, ps, pre_process=pp_rank == 0, post_process=pp_rank == pp - 1,
                     layer_range=(pp_rank * per, (pp_rank + 1) * per))


def saved_activation_bytes(cfg, pp_rank=0):
    """Bytes of the tensors autograd keeps from one training forward of one micro-batch on
    pipeline stage `pp_rank` (parameters excluded; a later stage's input counts, as the
    received activation does in a pipeline)."""
    model = stage_model(cfg, pp_rank=pp_rank)
    model.train()
    b, s = cfg.training.micro_batch_size, cfg.model.seq_length // cfg.parallel.context_parallel_size
    ids = torch.randint(0, cfg.raw_vocab_size, (b, s), generator=torch.Generator().manual_seed(0))
    if pp_rank > 0:
        model.set_input_tensor(torch.randn(b, s, cfg.model.hidden_size, requires_grad=True))
    mask = None
    if cfg.data.reset_attention_mask:
        mask = ~torch.ones(s, s, dtype=torch.bool).tril()[None, None].expand(b, 1, s, s)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages = {}

    def pack(t):
        storage = t.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(ids if pp_rank == 0 else None, None, mask, labels=ids)
    return sum(n for ptr, n in storages.items() if ptr not in params)
