"""GPU-only: DeepSpeed and native fp16 (dynamic loss scaling) and bf16, and the native path on CUDA.
Skipped without CUDA (CI has no GPU); run them on a GPU machine with `bash scripts/test.sh -k gpu`."""
import os
import math

import pytest
import torch

from tests.harness.corpus import read_metrics, tiny_gpt_args
from tests.harness.launch import ROOT, assert_close_curves, torchrun, train_curve

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

ITERS = ["--train-iters", "6", "--log-interval", "1", "--eval-iters", "1", "--eval-interval", "6",
         "--hidden-dropout", "0", "--attention-dropout", "0", "--global-batch-size", "8",
         "--micro-batch-size", "4", "--distributed-backend", "nccl"]


def _ds(name):
    return ["--deepspeed", "--deepspeed_config", os.path.join(ROOT, "ds_configs", f"{name}.json")]


@pytest.fixture(scope="module")
def fp32_curve(tiny_corpus, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gpu_fp32")
    torchrun(1, tiny_gpt_args(tiny_corpus, tmp, *ITERS, "--metrics-file", str(tmp / "m.jsonl")), tmp)
    return train_curve(tmp / "m.jsonl")


@pytest.mark.parametrize("precision,config", [("--fp16", "zero2"), ("--bf16", "zero2")])
def test_deepspeed_half_precision_on_gpu_tracks_fp32(tiny_corpus, fp32_curve, tmp_path,
                                                     precision, config):
    metrics = tmp_path / "m.jsonl"
    torchrun(1, tiny_gpt_args(tiny_corpus, tmp_path, *ITERS, precision, *_ds(config),
                              "--metrics-file", str(metrics)), tmp_path)
    rows = [r for r in read_metrics(metrics) if r["kind"] == "train"]
    assert [r["iteration"] for r in rows] == list(range(1, 7))
    for r in rows:
        assert math.isfinite(r["lm_loss"])
        if precision == "--fp16":  # dynamic loss scaling: the scale is logged (and may drop)
            assert r["loss_scale"] is not None and r["loss_scale"] >= 1
    for r in rows:
        if not r["total_skipped_iterations"]:  # after an fp16 overflow skip the runs diverge
            want = fp32_curve[r["iteration"]][0]
            assert abs(r["lm_loss"] - want) / want < 2e-2, (r["iteration"], r["lm_loss"], want)


def test_native_tp1_on_gpu_matches_cpu(tiny_corpus, fp32_curve, tmp_path):
    """The same fp32 run on the CPU (gloo) and on the GPU agree to TF32/cuBLAS rounding."""
    cpu = tmp_path / "cpu.jsonl"
    args = [a if a != "nccl" else "gloo" for a in ITERS]
    env_cuda = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    try:
        torchrun(1, tiny_gpt_args(tiny_corpus, tmp_path, *args, "--metrics-file", str(cpu)), tmp_path)
    finally:
        if env_cuda is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES")
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = env_cuda
    assert_close_curves(fp32_curve, train_curve(cpu), rel=1e-3, what="GPU vs CPU fp32")


@pytest.mark.parametrize("precision", [["--bf16"], ["--fp16"], ["--fp16",
                                                                "--accumulate-allreduce-grads-in-fp32"]])
def test_native_half_precision_on_gpu_tracks_fp32(tiny_corpus, fp32_curve, tmp_path, precision):
    """Native fp16 (dynamic loss scaling from 2^32: the first steps overflow and are skipped)
    and bf16 on CUDA: finite losses, loss scale logged, and the applied steps track fp32."""
    metrics = tmp_path / "m.jsonl"
    torchrun(1, tiny_gpt_args(tiny_corpus, tmp_path, *ITERS, *precision,
                              "--metrics-file", str(metrics)), tmp_path)
    rows = [r for r in read_metrics(metrics) if r["kind"] == "train"]
    assert [r["iteration"] for r in rows] == list(range(1, 7))
    for r in rows:
        if precision[0] == "--fp16":
            assert r["loss_scale"] is not None and r["loss_scale"] >= 1
        if r["lm_loss"] is not None and not r["total_skipped_iterations"]:
            want = fp32_curve[r["iteration"]][0]
            assert abs(r["lm_loss"] - want) / want < 2e-2, (r["iteration"], r["lm_loss"], want)
