"""DeepSpeed's ZeRO-aware Muon (`"optimizer": {"type": "Muon"}` in the JSON) at DP2, ZeRO-1,
ZeRO-2 and ZeRO-3, against the native Muon set up as DeepSpeed's (Nesterov, momentum 0.95, Keller
Jordan's coefficients, shape scaling, no QKV split), fp32, clipping off (DeepSpeed clips the
orthogonalised update, the native path the gradient): the same losses and the same weights
after five iterations. One spawn for the four runs."""
import contextlib
import json
import os

from tests.harness.distributed import run_distributed

ARGV = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "2",
        "--global-batch-size", "8", "--train-iters", "6", "--lr", "1e-2", "--min-lr", "1e-3",
        "--lr-warmup-iters", "1", "--lr-decay-style", "cosine", "--hidden-dropout", "0",
        "--attention-dropout", "0", "--distributed-backend", "gloo",
        "--make-vocab-size-divisible-by", "8", "--clip-grad", "0"]
AS_DEEPSPEED = ["--optimizer", "muon", "--muon-coefficient-type", "simple", "--muon-nesterov",
                "--muon-scale-mode", "shape_scaling", "--muon-momentum", "0.95",
                "--muon-no-split-qkv", "--muon-fp32-matmul-prec", "high"]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(argv):
    import torch.distributed as dist

    import arguments
    from app.mpu import random as mpu_random
    from tests.harness.synthetic import build_synthetic_run
    mpu_random.set_checkpoint_implementation(None)
    run = build_synthetic_run(arguments.config_from_argv(argv, dist.get_world_size(), 64), 128)
    losses = [run["trainer"].train_step(run["iterator"]).loss for _ in range(5)]
    model = run["engine"].module
    model = getattr(model, "module", model)  # the DeepSpeed engine wraps ours
    params = dict(model.named_parameters())
    whole = contextlib.nullcontext()
    if getattr(run["engine"], "partitioned", False):  # ZeRO-3: gather the pieces
        import deepspeed
        whole = deepspeed.zero.GatheredParameters(list(params.values()))
    with whole:
        return losses, {n: p.detach().numpy().copy() for n, p in params.items()}


def _main(tmpdir):
    import torch.distributed as dist
    from deepspeed.runtime.zero.muon.original_muon import ns_compute_dtype
    results = {"native": _run(ARGV + AS_DEEPSPEED), "dtype": str(ns_compute_dtype("gram"))}
    for stage in (1, 2, 3):
        with open(os.path.join(ROOT, "ds_configs", f"zero{stage}.json")) as f:
            config = json.load(f)
        # torch_adam: the auxiliary Adam is torch's AdamW, not DeepSpeed's FusedAdam, whose CPU
        # build (a C++ op compiled at first use, ~96 s of CPU) no GPU run uses
        config["optimizer"] = {"type": "Muon", "params": {"momentum": 0.95, "ns_method": "gram",
                                                          "torch_adam": True}}
        config["gradient_clipping"] = 0.0
        path = os.path.join(tmpdir, f"zero{stage}_muon.json")
        if dist.get_rank() == 0:
            with open(path + ".tmp", "w") as f:
                json.dump(config, f)
            os.replace(path + ".tmp", path)
        dist.barrier()
        results[f"ZeRO-{stage}"] = _run(ARGV + ["--deepspeed", "--deepspeed_config", path])
    return results


def test_deepspeed_muon_matches_native_muon_at_zero1_2_and_3(tmp_path):
    import torch
    results = run_distributed(_main, 2, str(tmp_path), timeout=600)
    for rank in results:
        # Newton-Schulz runs in fp32 where the CPU has no fp16 matmuls (DeepSpeed's gram
        # method picks fp16 where it can); then the runs agree to fp32 rounding
        exact = rank["dtype"] == "torch.float32"
        losses, weights = rank["native"]
        for stage in ("ZeRO-1", "ZeRO-2", "ZeRO-3"):
            ds_losses, ds_weights = rank[stage]
            torch.testing.assert_close(ds_losses, losses, rtol=1e-6 if exact else 1e-2, atol=0)
            assert ds_weights.keys() == weights.keys()
            for name, value in weights.items():
                # atol: AdamW turns the rounding noise of the key bias's zero gradient (softmax
                # ignores it) into steps of up to lr; elsewhere the weights agree to ~5e-7
                torch.testing.assert_close(torch.from_numpy(ds_weights[name]),
                                           torch.from_numpy(value), rtol=1e-5,
                                           atol=1e-5 if exact else 1e-3)
