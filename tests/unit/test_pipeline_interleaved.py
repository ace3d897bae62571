"""Interleaved 1F1B in one process: layer assignment, the order of work, and a simulation of every
rank's exchanges (rendezvous sends, per-direction FIFO channels) that checks each message reaches
the unit that needs it and that no layout deadlocks; start-up rules; ModelChunks' names."""
from __future__ import annotations

import pathlib
from typing import Dict, List, Tuple

import pytest
import torch

import arguments
from app.pipeline import ModelChunks, virtual_stage_layer_ranges
from app.pipeline.schedules import InterleavedPlan, _InterleavedRun

DS_JSON = str(pathlib.Path(__file__).resolve().parents[2] / "ds_configs" / "zero1.json")
BASE = ["--num-layers", "8", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--max-position-embeddings", "16", "--train-iters", "10",
        "--micro-batch-size", "1", "--distributed-backend", "gloo"]


def test_layers_are_dealt_round_robin_with_global_indices():
    # Megatron's example: 8 layers, PP = 2, 2 layers per virtual stage -> stage 0 holds 0,1 and 4,5
    assert virtual_stage_layer_ranges(8, 2, 2, 0) == [range(0, 2), range(4, 6)]
    assert virtual_stage_layer_ranges(8, 2, 2, 1) == [range(2, 4), range(6, 8)]
    assert virtual_stage_layer_ranges(8, 4, 2, 3) == [range(3, 4), range(7, 8)]
    assert virtual_stage_layer_ranges(8, 2, 1, 1) == [range(4, 8)]
    every = sorted(i for r in range(4) for chunk in virtual_stage_layer_ranges(16, 4, 2, r)
                   for i in chunk)
    assert every == list(range(16))


def test_plan_order_and_warmup_by_hand():
    plan = InterleavedPlan(pipeline_size=2, num_chunks=2, num_microbatches=4, rank=0)
    forward = [(plan.chunk(k), plan.microbatch(k)) for k in range(plan.total)]
    assert forward == [(0, 0), (0, 1), (1, 0), (1, 1), (0, 2), (0, 3), (1, 2), (1, 3)]
    backward = [(plan.chunk(k, False), plan.microbatch(k)) for k in range(plan.total)]
    assert backward == [(1, 0), (1, 1), (0, 0), (0, 1), (1, 2), (1, 3), (0, 2), (0, 3)]
    # warm-up: (PP - rank - 1) * 2 + (V - 1) * PP, everything when M == PP or forward-only
    assert plan.num_warmup == 4
    assert InterleavedPlan(2, 2, 4, 1).num_warmup == 2
    assert InterleavedPlan(4, 3, 8, 0).num_warmup == 6 + 8
    assert InterleavedPlan(2, 2, 2, 1).num_warmup == 4 and InterleavedPlan(2, 2, 2, 1).all_warmup
    assert InterleavedPlan(2, 2, 4, 1, forward_only=True).num_warmup == 8
    with pytest.raises(ValueError, match=r"micro-batches \(6\) to be a multiple of the "
                                         r"pipeline size \(4\)"):
        InterleavedPlan(4, 2, 6, 0)


class _Message:
    def __init__(self, kind: str, sender: int, chunk: int, micro: int) -> None:
        self.kind, self.sender, self.chunk, self.micro = kind, sender, chunk, micro


class _Slot:
    """A posted receive; records which unit consumes what arrives in it."""

    def __init__(self) -> None:
        self.consumer: Tuple[int, int] = (-1, -1)


class _SimulatedRank(_InterleavedRun):
    """The real control flow (`run`) with compute and communication replaced by records."""

    def __init__(self, plan: InterleavedPlan, forward_only: bool) -> None:
        super().__init__(plan, stage=None, model=None, forward_only=forward_only, ps=None,
                         shape=(1,), dtype=torch.float32, device=torch.device("cpu"))
        self.exchanges: List[Dict[str, list]] = []
        self.loss_micro: List[int] = []

    def forward(self, unit: int):
        plan = self.plan
        chunk, micro = plan.chunk(unit), plan.microbatch(unit)
        if not plan.is_first(chunk):
            self.received[chunk].pop(0).consumer = (chunk, micro)
        if not self.forward_only:
            self.saved[chunk].append((None, None))
        if plan.is_last(chunk):
            self.loss_micro.append(micro)
            return None
        return _Message("act", plan.rank, chunk, micro)

    def backward(self, unit: int):
        plan = self.plan
        chunk, micro = plan.chunk(unit, False), plan.microbatch(unit)
        self.saved[chunk].pop(0)
        if not plan.is_last(chunk):
            self.grads[chunk].pop(0).consumer = (chunk, micro)
        return None if plan.is_first(chunk) else _Message("grad", plan.rank, chunk, micro)

    def exchange(self, send_next=None, send_prev=None, recv_prev=False, recv_next=False):
        record = {"act_out": [send_next] if send_next is not None else [],
                  "grad_out": [send_prev] if send_prev is not None else [],
                  "act_in": [], "grad_in": []}
        if recv_prev:
            slot = _Slot()
            record["act_in"].append(slot)
            self.received[next(self.input_chunks)].append(slot)
        if recv_next:
            slot = _Slot()
            record["grad_in"].append(slot)
            self.grads[next(self.grad_chunks)].append(slot)
        self.exchanges.append(record)


def _simulate(pp: int, vp: int, micro: int, forward_only: bool) -> List[_SimulatedRank]:
    """Run every rank's schedule, then replay the exchanges with rendezvous semantics: an exchange
    completes once every message in it is matched (per-direction FIFO) by an exchange its peer
    has reached; fails on a deadlock or a message delivered to the wrong unit."""
    ranks = [_SimulatedRank(InterleavedPlan(pp, vp, micro, r, forward_only), forward_only)
             for r in range(pp)]
    for rank in ranks:
        rank.run()

    def stream(r: int, key: str) -> List[Tuple[int, object]]:  # (exchange index, item)
        return [(i, item) for i, ex in enumerate(ranks[r].exchanges) for item in ex[key]]

    channels = {}  # (sender, kind) -> list of (sender exchange, receiver exchange, msg, slot)
    for r in range(pp):
        for kind, out_key, in_key, peer in (("act", "act_out", "act_in", (r + 1) % pp),
                                            ("grad", "grad_out", "grad_in", (r - 1) % pp)):
            sent, got = stream(r, out_key), stream(peer, in_key)
            assert len(sent) == len(got), f"rank {r} sends {len(sent)} {kind}, rank {peer} " \
                                          f"receives {len(got)}"
            channels[(r, kind)] = [(i, j, msg, slot) for (i, msg), (j, slot) in zip(sent, got)]
            ring = 1 if (kind == "act" and r == pp - 1) else -1 if (kind == "grad" and r == 0) \
                else 0
            for _, _, msg, slot in channels[(r, kind)]:
                assert slot.consumer == (msg.chunk + ring, msg.micro), (kind, r, msg.chunk,
                                                                        msg.micro, slot.consumer)
    # every op of exchange i on rank r waits for its counterpart: (peer, the peer's exchange)
    waits: Dict[Tuple[int, int], List[Tuple[int, int]]] = {}
    for (sender, kind), matches in channels.items():
        receiver = (sender + 1) % pp if kind == "act" else (sender - 1) % pp
        for i, j, _, _ in matches:
            waits.setdefault((sender, i), []).append((receiver, j))
            waits.setdefault((receiver, j), []).append((sender, i))
    position = [0] * pp  # the exchange each rank has posted and waits in
    while any(position[r] < len(ranks[r].exchanges) for r in range(pp)):
        ready = [r for r in range(pp) if position[r] < len(ranks[r].exchanges) and
                 all(position[peer] >= j for peer, j in waits.get((r, position[r]), []))]
        assert ready, f"deadlock at exchanges {position} (PP {pp}, V {vp}, M {micro})"
        for r in ready:
            position[r] += 1
    return ranks


@pytest.mark.parametrize("pp,vp,micro", [(2, 2, 2), (2, 2, 4), (2, 3, 6), (3, 2, 3), (3, 2, 9),
                                         (4, 2, 4), (4, 2, 8), (4, 3, 12), (4, 4, 16)])
def test_simulated_exchanges_deliver_every_message_without_deadlock(pp, vp, micro):
    for forward_only in (False, True):
        ranks = _simulate(pp, vp, micro, forward_only)
        assert ranks[-1].loss_micro == list(range(micro))


def test_start_up_rules_name_both_flags_and_the_fix():
    def error(extra, world):
        with pytest.raises(ValueError) as info:
            arguments.config_from_argv(BASE + extra, world, 100)
        return str(info.value)

    flag = "--num-layers-per-virtual-pipeline-stage"
    message = error([flag, "2", "--global-batch-size", "4"], 1)
    assert flag in message and "--pipeline-model-parallel-size > 1" in message
    message = error([flag, "3", "--pipeline-model-parallel-size", "2",
                     "--global-batch-size", "4"], 2)
    assert "--num-layers (8) / --pipeline-model-parallel-size (2) = 4" in message
    assert f"{flag} (3)" in message and "divides 4" in message
    message = error([flag, "1", "--pipeline-model-parallel-size", "4",
                     "--global-batch-size", "6"], 4)
    assert "--pipeline-model-parallel-size (4)" in message and "--global-batch-size (6)" in message
    assert "multiple of 4" in message and flag in message
    message = error([flag, "1", "--pipeline-model-parallel-size", "2", "--global-batch-size", "4",
                     "--deepspeed", "--deepspeed_config", DS_JSON], 2)
    assert flag in message and "--deepspeed" in message
    cfg = arguments.config_from_argv(BASE + [flag, "2", "--pipeline-model-parallel-size", "2",
                                             "--global-batch-size", "4"], 2, 100)
    assert cfg.virtual_pipeline_model_parallel_size == 2


def test_model_chunks_name_parameters_globally():
    from app.model import GPT2Model
    cfg = arguments.config_from_argv(BASE + ["--global-batch-size", "1"], 1, 100).model
    chunks = ModelChunks([GPT2Model(cfg, layer_range=(0, 2), post_process=False),
                          GPT2Model(cfg, layer_range=(4, 6), pre_process=False,
                                    post_process=False)])
    names = list(chunks.state_dict())
    assert "language_model.embedding.word_embeddings.weight" in names
    layers = sorted({int(n.split(".")[3]) for n in names if ".layers." in n})
    assert layers == [0, 1, 4, 5]
    whole = GPT2Model(cfg).state_dict()
    for name, value in chunks.state_dict().items():  # init depends only on the global name
        torch.testing.assert_close(value, whole[name], rtol=0, atol=0)
    changed = {n: v + 1 for n, v in chunks.state_dict().items()}
    chunks.load_state_dict(changed)
    for name, value in chunks.state_dict().items():
        torch.testing.assert_close(value, changed[name], rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="unexpected keys"):
        chunks.load_state_dict({**changed, "language_model.transformer.layers.2.x": whole[
            "language_model.transformer.layers.2.input_layernorm.weight"]})
    chunks.eval().set_chunk(1)
    hidden = torch.randn(2, 16, 32)
    chunks.set_input_tensor(hidden)
    assert chunks(None).shape == (2, 16, 32)
