"""Muon in one process: Newton-Schulz against the SVD's polar factor U V^T, its coefficients
checked on singular values by hand, the scale modes and the fused-QKV split by hand, one Muon
step against a hand-written update, the param groups on GPT-2, state round trips, fp16 loss
scaling removed before the orthogonalisation, and the start-up rules of the flags."""
import copy
import re

import pytest
import torch
from torch import nn

import arguments
from app.config import OptimizerConfig, PrecisionConfig
from app.model import GPT2Model
from app.mpu.parallel_state import ParallelState
from app.optim import build_optimizer
from app.optim.mixed_precision import Float32Optimizer, MixedPrecisionOptimizer
from app.optim.muon import MatrixSpec, Muon, TensorParallelOrthogonalizer
from app.optim.newton_schulz import join_qkv_rows, newton_schulz, scale_factor, split_qkv_rows

PS = ParallelState.single()


def polar(matrix):
    """U V^T of the reduced SVD: the orthogonal factor Newton-Schulz approximates."""
    u, _, vh = torch.linalg.svd(matrix.double(), full_matrices=False)
    return (u @ vh).float()


@pytest.mark.parametrize("shape", [(16, 48), (48, 16), (24, 24)])
def test_quintic_keeps_the_singular_vectors_and_moves_singular_values_near_one(shape):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    out = newton_schulz(x, 5, "quintic", "high")
    u, s, vh = torch.linalg.svd(x.double(), full_matrices=False)
    core = u.T @ out.double() @ vh.T  # diagonal: an odd polynomial of X keeps U and V
    diag = core.diagonal()
    assert (core - torch.diag(diag)).abs().max() < 1e-5 * diag.abs().max()
    assert diag.min() > 0.6 and diag.max() < 1.25, diag  # near 1, not on it (tuned for speed)


@pytest.mark.parametrize("shape", [(16, 48), (48, 16)])
def test_polar_express_converges_to_the_polar_factor(shape):
    """Its last tuple (15/8, -10/8, 3/8) is the classical quintic iteration, which converges."""
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(newton_schulz(x, 25, "polar_express", "high"), polar(x),
                               rtol=0, atol=2e-5)


def test_coefficients_by_hand_on_a_diagonal_matrix():
    """diag(3, 4) normalises to singular values 0.6 and 0.8; each step maps s to
    a s + b s^3 + c s^5 with the schedule's (a, b, c), written out here."""
    x = torch.diag(torch.tensor([3.0, 4.0]))
    quintic = [(4.0848, -6.8946, 2.9270), (3.9505, -6.3029, 2.6377)]
    s = [0.6, 0.8]
    for steps in (1, 2):
        a, b, c = quintic[steps - 1]
        s = [a * v + b * v ** 3 + c * v ** 5 for v in s]
        out = newton_schulz(x, steps, "quintic", "high")
        torch.testing.assert_close(out.diagonal(), torch.tensor(s), rtol=1e-5, atol=1e-6)
    simple = [0.6, 0.8]
    for _ in range(6):  # one tuple, cycled
        simple = [3.4445 * v - 4.7750 * v ** 3 + 2.0315 * v ** 5 for v in simple]
    torch.testing.assert_close(newton_schulz(x, 6, "simple", "high").diagonal(),
                               torch.tensor(simple), rtol=1e-5, atol=1e-6)


def test_bf16_iteration_is_close_to_fp32():
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(2))
    low = newton_schulz(x, 5, "quintic", "medium")
    assert low.dtype == torch.float32
    torch.testing.assert_close(low, newton_schulz(x, 5, "quintic", "high"), rtol=0, atol=0.03)


def test_scale_modes_by_hand():
    assert scale_factor(64, 16, "spectral") == 8.0
    assert scale_factor(16, 64, "spectral") == 8.0
    assert scale_factor(16, 64, "unit_rms_norm") == 0.5
    assert scale_factor(64, 16, "unit_rms_norm") == 2.0
    assert scale_factor(16, 64, "shape_scaling") == 1.0
    assert scale_factor(64, 16, "shape_scaling") == 2.0
    assert scale_factor(64, 16, "spectral", extra=0.2) == pytest.approx(1.6)
    with pytest.raises(ValueError, match="--muon-scale-mode"):
        scale_factor(4, 4, "rms")


def test_split_qkv_by_hand():
    """Rows [groups, (q heads, k, v), head_dim] with 2 groups, 2 queries each, head_dim 1."""
    labels = ["g0q0", "g0q1", "g0k", "g0v", "g1q0", "g1q1", "g1k", "g1v"]
    fused = torch.arange(8.0)[:, None].repeat(1, 3)  # row i holds i
    q, k, v = split_qkv_rows(fused, groups=2, queries_per_group=2, head_dim=1)
    rows = lambda t: [labels[int(r)] for r in t[:, 0]]
    assert rows(q) == ["g0q0", "g0q1", "g1q0", "g1q1"]
    assert rows(k) == ["g0k", "g1k"] and rows(v) == ["g0v", "g1v"]
    assert torch.equal(join_qkv_rows([q, k, v], groups=2), fused)


def _config(**muon):
    settings = dict(optimizer="muon", muon_coefficient_type="polar_express", muon_num_ns_steps=25,
                    muon_fp32_matmul_prec="high")
    settings.update(muon)
    return OptimizerConfig(lr=0.1, weight_decay=0.1, lr_decay_iters=10, clip_grad=0.0,
                           **settings)


def test_split_qkv_orthogonalises_queries_keys_and_values_apart():
    gen = torch.Generator().manual_seed(3)
    fused = torch.randn(2 * (2 + 2) * 4, 8, generator=gen)  # 2 groups, 2 queries, head_dim 4
    spec = MatrixSpec(qkv=(2, 2, 4))
    got = TensorParallelOrthogonalizer(_config(muon_scale_mode="unit_rms_norm"))(fused, spec)
    parts = split_qkv_rows(fused, 2, 2, 4)
    want = join_qkv_rows([polar(p) * (p.shape[0] / p.shape[1]) ** 0.5 for p in parts], 2)
    torch.testing.assert_close(got, want, rtol=0, atol=5e-5)
    whole = TensorParallelOrthogonalizer(_config(muon_split_qkv=False))(fused, spec)
    torch.testing.assert_close(whole, polar(fused) * 32 ** 0.5, rtol=0, atol=2e-4)


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.norm, self.fc2 = nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 4)


@pytest.mark.parametrize("nesterov", [False, True])
def test_two_muon_steps_match_the_update_written_out(nesterov):
    net = _Net()
    cfg = _config(muon_momentum=0.8, muon_nesterov=nesterov)
    opt = build_optimizer(net, cfg)
    assert isinstance(opt, Muon)
    assert [g["name"] for g in opt.param_groups] == ["muon", "no_decay"]
    matrices = {"fc1.weight": net.fc1.weight, "fc2.weight": net.fc2.weight}
    weights = {n: p.detach().clone() for n, p in matrices.items()}
    momentum = {n: torch.zeros_like(w) for n, w in weights.items()}
    gen = torch.Generator().manual_seed(4)
    for _ in range(2):
        grads = {n: torch.randn(p.shape, generator=gen) for n, p in net.named_parameters()}
        for n, p in net.named_parameters():
            p.grad = grads[n].clone()
        opt.step()
        for n, w in weights.items():
            momentum[n] = 0.8 * momentum[n] + 0.2 * grads[n]
            u = 0.2 * grads[n] + 0.8 * momentum[n] if nesterov else momentum[n]
            rows, cols = w.shape
            weights[n] = w * (1 - 0.1 * 0.1) - 0.1 * max(rows, cols) ** 0.5 * polar(u)
            torch.testing.assert_close(matrices[n].detach(), weights[n], rtol=0, atol=2e-5)
    assert set(opt.state[net.fc1.weight]) == {"momentum_buffer"}
    assert set(opt.state[net.fc1.bias]) == {"step", "exp_avg", "exp_avg_sq"}


def test_state_dict_round_trip_continues_exactly():
    gen = torch.Generator().manual_seed(5)
    grads = [{n: torch.randn(p.shape, generator=gen) for n, p in _Net().named_parameters()}
             for _ in range(3)]

    def run(net, opt, steps):
        for g in steps:
            for n, p in net.named_parameters():
                p.grad = g[n].clone()
            opt.step()

    net, cfg = _Net(), _config(muon_coefficient_type="quintic", muon_num_ns_steps=5)
    opt = build_optimizer(net, cfg)
    run(net, opt, grads[:2])
    saved = copy.deepcopy(opt.state_dict())  # as read back from a file: no shared tensors
    other = _Net()
    other.load_state_dict(net.state_dict())
    resumed = build_optimizer(other, cfg)
    resumed.load_state_dict(saved)
    assert resumed.scalar.state is resumed.state  # AdamW reads the loaded moments
    run(net, opt, grads[2:])
    run(other, resumed, grads[2:])
    for (name, a), b in zip(net.state_dict().items(), other.state_dict().values()):
        assert torch.equal(a, b), name


def test_gpt2_groups_give_muon_the_layer_matrices_only():
    cfg = arguments.config_from_argv(
        ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "16", "--train-iters", "2", "--make-vocab-size-divisible-by", "8",
         "--untie-embeddings-and-output-weights", "--optimizer", "muon"], 1, 64)
    model = GPT2Model(cfg.model)
    wrapper = Float32Optimizer(model, cfg.optimizer, PS)
    names = {id(p): n for n, p in model.named_parameters()}
    groups = {g["name"]: sorted(names[id(p)].split(".", 1)[1] for p in g["params"])
              for g in wrapper.param_groups}
    layer = lambda i, s: f"transformer.layers.{i}.{s}"
    assert groups["muon"] == sorted(layer(i, s) for i in (0, 1) for s in (
        "attention.query_key_value.weight", "attention.dense.weight", "mlp.dense_h_to_4h.weight",
        "mlp.dense_4h_to_h.weight"))
    assert groups["decay"] == ["embedding.position_embeddings.weight",
                               "embedding.word_embeddings.weight", "output_layer.weight"]
    assert all(n.endswith("bias") or "layernorm" in n for n in groups["no_decay"])


def test_moe_experts_are_orthogonalised_one_matrix_per_expert():
    """Mixture of Experts: the routed experts' 3-D weights form the `expert_muon` group and each
    expert's matrix gets the update of a 2-D Muon matrix of its shape (the router is a 2-D
    layer matrix too); written out for one step."""
    cfg = arguments.config_from_argv(
        ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "16", "--train-iters", "2", "--make-vocab-size-divisible-by", "8",
         "--swiglu", "--disable-bias-linear", "--num-experts", "4", "--moe-ffn-hidden-size", "8",
         "--optimizer", "muon", "--muon-fp32-matmul-prec", "high", "--lr", "0.1",
         "--weight-decay", "0.1", "--muon-coefficient-type", "polar_express",
         "--muon-num-ns-steps", "25"], 1, 64)  # converged: the SVD's polar factor
    model = GPT2Model(cfg.model)
    wrapper = Float32Optimizer(model, cfg.optimizer, PS)
    names = {id(p): n for n, p in model.named_parameters()}
    groups = {g["name"]: sorted(names[id(p)] for p in g["params"]) for g in wrapper.param_groups}
    assert groups["expert_muon"] == sorted(n for n in names.values() if ".mlp.experts." in n)
    assert "language_model.transformer.layers.0.mlp.router.weight" in groups["muon"]
    fc1 = model.language_model.transformer.layers["0"].mlp.experts.dense_h_to_4h.weight
    before = fc1.detach().clone()  # [4, 16, 32]
    gen = torch.Generator().manual_seed(6)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen)
    grad = fc1.grad.clone()
    wrapper.step(PS, 0.0, None)
    lr = wrapper.param_groups[0]["lr"]
    for e in range(4):  # momentum (1 - 0.9) g, scaled by sqrt(max(16, 32)) (spectral)
        want = before[e] * (1 - lr * 0.1) - lr * 32 ** 0.5 * polar(0.1 * grad[e])
        torch.testing.assert_close(fc1.detach()[e], want, rtol=0, atol=2e-5)


def test_fp16_gradients_are_unscaled_before_the_orthogonalisation():
    """The loss scale doubles after every step (window 1); Muon's momentum must still add the
    true gradients, as an fp32 run given the same gradients does."""
    cfg = _config(muon_coefficient_type="quintic", muon_num_ns_steps=5)
    half, full = _Net().half(), _Net()
    mixed = MixedPrecisionOptimizer(half, cfg, PrecisionConfig(
        fp16=True, initial_loss_scale=1024.0, loss_scale_window=1))
    reference = Float32Optimizer(full, cfg)
    gen = torch.Generator().manual_seed(6)
    for _ in range(3):
        scale = mixed.loss_scale
        grads = {n: torch.randn(p.shape, generator=gen).half().float()
                 for n, p in full.named_parameters()}
        for n, p in half.named_parameters():
            p.grad = (grads[n] * scale).half()
        for n, p in full.named_parameters():
            p.grad = grads[n].clone()
        assert not mixed.step(PS, 0.0, None).skipped
        reference.step(PS, 0.0, None)
    assert mixed.loss_scale == 8192.0
    for main, p in zip(mixed.main_params, full.parameters()):
        torch.testing.assert_close(main.detach(), p.detach(), rtol=0, atol=1e-3)


BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--train-iters", "2", "--make-vocab-size-divisible-by", "8",
        "--distributed-backend", "gloo"]


def test_flags_have_megatrons_defaults_and_reach_the_config():
    o = arguments.config_from_argv(BASE, 1, 64).optimizer
    assert (o.optimizer, o.muon_momentum, o.muon_nesterov, o.muon_split_qkv, o.muon_scale_mode,
            o.muon_num_ns_steps, o.muon_coefficient_type, o.muon_fp32_matmul_prec,
            o.muon_tp_mode, o.muon_extra_scale_factor, o.muon_scalar_optimizer) == (
        "adam", 0.9, False, True, "spectral", 5, "quintic", "medium", "duplicated", 1.0, "adam")
    o = arguments.config_from_argv(BASE + [
        "--optimizer", "muon", "--muon-momentum", "0.95", "--muon-nesterov", "--muon-no-split-qkv",
        "--muon-scale-mode", "shape_scaling", "--muon-num-ns-steps", "3",
        "--muon-coefficient-type", "simple", "--muon-fp32-matmul-prec", "high",
        "--muon-tp-mode", "distributed", "--muon-extra-scale-factor", "0.2"], 1, 64).optimizer
    assert (o.optimizer, o.muon_momentum, o.muon_nesterov, o.muon_split_qkv, o.muon_scale_mode,
            o.muon_num_ns_steps, o.muon_coefficient_type, o.muon_fp32_matmul_prec,
            o.muon_tp_mode, o.muon_extra_scale_factor) == (
        "muon", 0.95, True, False, "shape_scaling", 3, "simple", "high", "distributed", 0.2)


@pytest.mark.parametrize("flags,message", [
    (["--muon-num-ns-steps", "0"], "--muon-num-ns-steps must be >= 1"),
    (["--muon-momentum", "1.0"], r"--muon-momentum must be in \[0, 1\)"),
    (["--tensor-model-parallel-size", "2", "--group-query-attention", "--num-query-groups", "1",
      "--muon-no-split-qkv"], "--muon-no-split-qkv with --muon-tp-mode duplicated"),
])
def test_bad_muon_flags_are_refused_with_the_flag_named(flags, message):
    with pytest.raises(ValueError, match=message):
        arguments.config_from_argv(BASE + ["--optimizer", "muon"] + flags, 2, 64)


def _gpt_steps(model, optimizer, n):
    gen = torch.Generator().manual_seed(3)
    norms = []
    for _ in range(n):
        optimizer.zero_grad()
        for _ in range(2):  # two micro-batches
            ids = torch.randint(0, 64, (2, 16), generator=gen)
            loss = model(ids, labels=torch.roll(ids, -1, 1)).mean() / 2
            optimizer.scale_loss(loss).backward()
        optimizer.reduction_grads()
        norms.append(optimizer.step(PS, 0.05, None).grad_norm)
    return norms


@pytest.mark.parametrize("optimizer", [["--optimizer", "muon", "--muon-fp32-matmul-prec", "high"],
                                       ["--optimizer", "sgd"]], ids=["muon", "sgd"])
def test_distributed_optimizer_steps_and_saves_like_the_plain_wrapper(optimizer):
    """Small buckets split matrices between shards; at DP 1 the gathered Newton-Schulz input is
    the whole momentum, so the steps and the saved state are the plain wrapper's exactly."""
    from app.optim.distributed_optimizer import DistributedOptimizer
    cfg = arguments.config_from_argv(BASE + optimizer + [
        "--use-distributed-optimizer", "--ddp-bucket-size", "3000", "--micro-batch-size", "2",
        "--global-batch-size", "4", "--hidden-dropout", "0", "--attention-dropout", "0"], 1, 64)
    plain_model, sharded_model = GPT2Model(cfg.model), GPT2Model(cfg.model)
    plain = Float32Optimizer(plain_model, cfg.optimizer, PS)
    sharded = DistributedOptimizer(sharded_model, cfg.optimizer, cfg.precision, PS, 2)
    torch.testing.assert_close(_gpt_steps(sharded_model, sharded, 3),  # norms summed from shards
                               _gpt_steps(plain_model, plain, 3), rtol=1e-6, atol=0)
    for (name, a), b in zip(plain_model.state_dict().items(), sharded_model.state_dict().values()):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7, msg=name)
    mine, theirs = sharded.state_dict(), plain.state_dict()
    assert mine["param_groups"] == theirs["param_groups"]
    assert mine["state"].keys() == theirs["state"].keys()
    for index, entry in theirs["state"].items():
        assert entry.keys() == mine["state"][index].keys(), index
        for key, value in entry.items():
            torch.testing.assert_close(torch.as_tensor(mine["state"][index][key]).float(),
                                       torch.as_tensor(value).float(), rtol=1e-5, atol=1e-7)
    plain.load_state_dict(mine)
    sharded.load_state_dict(theirs)
    torch.testing.assert_close(_gpt_steps(sharded_model, sharded, 1),
                               _gpt_steps(plain_model, plain, 1), rtol=1e-5, atol=0)


def test_a_checkpoint_of_another_optimizer_is_refused_by_name():
    def wrapper(*flags):
        cfg = arguments.config_from_argv(BASE + list(flags), 1, 64)
        return Float32Optimizer(GPT2Model(cfg.model), cfg.optimizer, PS)
    adam = wrapper().state_dict()
    for flags in (["--optimizer", "muon"], ["--optimizer", "sgd"]):
        with pytest.raises(ValueError, match="saved with another optimizer.*--no-load-optim"):
            wrapper(*flags).load_state_dict(adam)
    wrapper().load_state_dict(adam)


def _ds_config(tmp_path, optimizer=None):
    import json
    config = {"zero_optimization": {"stage": 2}}
    if optimizer:
        config["optimizer"] = optimizer
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    return ["--deepspeed", "--deepspeed_config", str(path)]


def test_deepspeed_muon_comes_from_the_json(tmp_path):
    muon = _ds_config(tmp_path, {"type": "Muon", "params": {"momentum": 0.95}})
    cfg = arguments.config_from_argv(BASE + muon, 2, 64)
    assert cfg.optimizer.optimizer == "muon"
    assert cfg.deepspeed.config["optimizer"]["params"]["momentum"] == 0.95
    path = tmp_path / "m.json"
    path.write_text('{"optimizer": {"type": "Muon"}}')
    cfg = arguments.config_from_argv(BASE + ["--deepspeed", "--deepspeed_config", str(path),
                                             "--optimizer", "muon", "--muon-momentum", "0.8"],
                                     2, 64)
    assert cfg.deepspeed.config["optimizer"]["params"]["momentum"] == 0.8
    cfg = arguments.config_from_argv(BASE + ["--deepspeed", "--deepspeed_config", str(path),
                                             "--tensor-model-parallel-size", "2",
                                             "--muon-tp-mode", "blockwise"], 2, 64)
    assert cfg.optimizer.optimizer == "muon"


@pytest.mark.parametrize("json_optimizer,flags,message", [
    (None, ["--optimizer", "muon"], 'add "optimizer": {"type": "Muon"'),
    ({"type": "Muon"}, ["--optimizer", "adam"], "optimizer.type is 'Muon' but --optimizer is adam"),
    ({"type": "AdamW"}, ["--optimizer", "muon"],
     "optimizer.type is 'AdamW' but --optimizer is muon"),
    ({"type": "Muon"}, ["--muon-scale-mode", "spectral"], "does not take --muon-scale-mode"),
    ({"type": "Muon"}, ["--tensor-model-parallel-size", "2"], "pass --muon-tp-mode blockwise"),
    ({"type": "Muon"}, ["--untie-embeddings-and-output-weights"], "untied output layer"),
    ({"type": "Muon", "params": {"momentum": 0.95}}, ["--muon-momentum", "0.9"],
     "optimizer.params.momentum is 0.95 but --muon-momentum is 0.9"),
    (None, ["--optimizer", "sgd"], '"zero_allow_untested_optimizer": true'),
])
def test_deepspeed_muon_refusals_say_what_works(tmp_path, json_optimizer, flags, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        arguments.config_from_argv(BASE + _ds_config(tmp_path, json_optimizer) + flags, 2, 64)
