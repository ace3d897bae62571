"""DeepSpeed ZeRO-3 end to end on CPU (gloo, fp32, DP 2, the tiny corpus; parity with the native
path in tests/distributed/test_deepspeed_zero3.py): one run saving at iterations 3 and 6
(evaluating at 3 and 6) is resumed, converted and read back.

- the files are DeepSpeed's ZeRO-3 layout (a module file per data-parallel rank), each with its
  SHA-256 sidecar; a run resumed from iteration 3 logs the uninterrupted run's losses bit for
  bit, and refuses a damaged file by its checksum; the log shows the gradient norm, the
  validation loss and the bytes each rank holds;
- DeepSpeed's own zero_to_fp32 reads the checkpoint, and our converter's Megatron (legacy)
  checkpoint holds the same weights; its Hugging Face export greedy-generates what tools/generate.py
  generates from the ZeRO-3 checkpoint itself;
- at DP 1: ds_to_universal + --universal-checkpoint, and the converter's torch_dist checkpoint
  with the Adam moments resumed on the native path, continue the uninterrupted losses within
  1e-5 (its Megatron legacy output is checked above); --no-load-optim loads the weights
  (ZeRO-3 pieces of another DP size) and the LR schedule;
- a ZeRO-2 run refuses the ZeRO-3 checkpoint with the fix, before DeepSpeed reads a file.

Runs that must succeed train through pretrain_gpt2 in forked ranks
(tests.harness.distributed.run_pretrain) and the converter runs in-process (its main()); the
refusals run the command line (exit codes): the damaged file under torchrun, the ZeRO-2 run as
`pretrain_gpt2.py` (tests.harness.distributed.run_main).
"""
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from tests.harness.distributed import run_main, run_pretrain
from tests.harness.tools import run_tool
from tests.harness.corpus import ZERO2_DP2_ARGS, tiny_gpt_args
from tests.harness.launch import ROOT, assert_close_curves, env, run, train_curve

ZERO3 = ["--deepspeed", "--deepspeed_config", os.path.join(ROOT, "ds_configs", "zero3.json")]
COMMON = [*ZERO2_DP2_ARGS, "--eval-interval", "3"]
EVAL = ["--eval-iters", "1"]


def _later(curve, after=3):
    return {k: v for k, v in curve.items() if k > after}


@pytest.fixture(scope="module")
def zero3_dp2(tiny_corpus, tmp_path_factory):
    """The uninterrupted ZeRO-3 DP 2 run: its checkpoints of 3 and 6 in `ck/`, its metrics in
    `straight.jsonl`, its output."""
    tmp = tmp_path_factory.mktemp("zero3_dp2")
    outs = run_pretrain(2, tiny_gpt_args(tiny_corpus, tmp, *COMMON, *EVAL, *ZERO3, "--save",
                                         str(tmp / "ck"), "--metrics-file",
                                         str(tmp / "straight.jsonl")))
    return tmp, "".join(outs)


def _copy_of_iteration(ck, dest, iteration=3):
    """A checkpoint directory whose latest (tracker and DeepSpeed's `latest`) is `iteration`."""
    tag = f"iter_{iteration:07d}"
    shutil.copytree(ck / tag, dest / tag)
    (dest / "latest").write_text(tag)
    (dest / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    return dest


def test_zero3_files_resume_and_log(tiny_corpus, zero3_dp2):
    tmp, log = zero3_dp2
    files = sorted(os.listdir(tmp / "ck" / "iter_0000006"))
    for dp in (0, 1):
        for kind in ("model", "optim"):
            name = f"zero_pp_rank_{dp}_mp_rank_00_{kind}_states.pt"
            assert name in files and f".{name}.sha256" in files, files
    from tests.harness.corpus import read_metrics
    rows = read_metrics(tmp / "straight.jsonl")
    valid = {r["iteration"]: r["lm_loss"] for r in rows if r["kind"] == "valid"}
    assert sorted(valid) == [3, 6] and all(0 < v < 10 for v in valid.values()), valid
    assert "valid loss at iteration 6" in log, log[-3000:]
    assert "state held by rank 1 (DeepSpeedEngineAdapter)" in log, log[-3000:]
    straight = train_curve(tmp / "straight.jsonl")
    assert all(norm > 0 for _, norm in straight.values()), straight
    resumed_dir = _copy_of_iteration(tmp / "ck", tmp / "resume")
    run_pretrain(2, tiny_gpt_args(tiny_corpus, tmp, *COMMON, *EVAL, *ZERO3, "--load",
                                  str(resumed_dir), "--metrics-file", str(tmp / "resumed.jsonl")))
    assert train_curve(tmp / "resumed.jsonl") == _later(straight)

    # integrity: a flipped byte in one rank's ZeRO-3 pieces is refused by its checksum
    damaged = resumed_dir / "iter_0000003" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0xFF
    damaged.write_bytes(bytes(data))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node=2", os.path.join(ROOT, "pretrain_gpt2.py"),
                           *tiny_gpt_args(tiny_corpus, tmp, *COMMON, *EVAL, *ZERO3, "--load",
                                          str(resumed_dir))],
                          capture_output=True, text=True, env=env(), cwd=tmp, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "is corrupt: its SHA-256" in out, out[-3000:]
    assert "zero_pp_rank_1_mp_rank_00_optim_states.pt" in out


def test_zero3_converts_like_zero_to_fp32_and_generates(tiny_corpus, zero3_dp2):
    transformers = pytest.importorskip("transformers")
    tmp, _ = zero3_dp2
    ck = tmp / "ck"
    run([sys.executable, str(ck / "zero_to_fp32.py"), str(ck), str(tmp / "fp32"), "--tag",
         "iter_0000006"], tmp)
    fp32 = torch.load(str(tmp / "fp32" / "pytorch_model.bin"), weights_only=True)
    convert = ["--input-format", "deepspeed", "--load", str(ck), "--iteration", "6"]
    run_tool("convert_checkpoint", [*convert, "--save", str(tmp / "megatron")])
    from app.checkpoint.legacy import per_rank as ckpt
    state, iteration = ckpt.load_checkpoint_dict(str(tmp / "megatron"))
    flat = ckpt.from_megatron_model(state["model"])
    assert iteration == 6 and set(flat) == set(fp32)
    for name, value in fp32.items():
        assert torch.equal(flat[name], value), name

    hf_dir = tmp / "hf"
    run_tool("convert_checkpoint", [*convert, "--output-format", "hf", "--save", str(hf_dir),
                                    "--vocab-file", tiny_corpus["vocab"], "--merge-file",
                                    tiny_corpus["merges"]])
    prompt = "import os\nimport"
    out = run([sys.executable, os.path.join(ROOT, "tools", "generate.py"), "--load", str(ck),
               "--vocab-file", tiny_corpus["vocab"], "--merge-file", tiny_corpus["merges"],
               "--prompt", prompt, "--max-new-tokens", "8", "--greedy", "--output", "jsonl"],
              tmp)
    row = json.loads(out.stdout.strip().splitlines()[-1])
    hf = transformers.GPT2LMHeadModel.from_pretrained(str(hf_dir)).eval()
    tok = transformers.AutoTokenizer.from_pretrained(str(hf_dir))
    ids = tok(prompt)["input_ids"]
    want = hf.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False,
                       eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id)
    assert row["generated_tokens"] == want[0, len(ids):].tolist()[:len(row["generated_tokens"])]


def test_zero3_resumes_at_dp1(tiny_corpus, zero3_dp2):
    """Universal checkpoint and converter (optimizer states continue: the losses follow the
    uninterrupted run); --no-load-optim (fresh Adam: only the first loss, taken before any
    update, must be the uninterrupted one)."""
    from pretrain_gpt2 import run as pretrain
    tmp, _ = zero3_dp2
    straight = train_curve(tmp / "straight.jsonl")
    universal = _copy_of_iteration(tmp / "ck", tmp / "universal")
    run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
         str(universal / "iter_0000003"), "--output_folder",
         str(universal / "iter_0000003_universal"), "--num_extract_workers", "1",
         "--num_merge_workers", "1"], tmp)
    run_pretrain(1, tiny_gpt_args(tiny_corpus, tmp, *COMMON, *ZERO3, "--load", str(universal),
                                  "--universal-checkpoint", "--metrics-file", str(tmp / "u.jsonl")))
    worst = assert_close_curves(train_curve(tmp / "u.jsonl"), _later(straight),
                                what="universal ZeRO-3 DP2 -> DP1")
    print(f"ZeRO-3 DP2 -> universal -> DP1 vs uninterrupted: {worst:.2e}")

    run_tool("convert_checkpoint", ["--input-format", "deepspeed", "--output-format", "torch_dist",
                                    "--load", str(tmp / "ck"), "--save", str(tmp / "native"),
                                    "--iteration", "3", "--include-optimizer"])
    pretrain(tiny_gpt_args(tiny_corpus, tmp, *COMMON, "--load", str(tmp / "native"),
                           "--metrics-file", str(tmp / "n.jsonl")))
    worst = assert_close_curves(train_curve(tmp / "n.jsonl"), _later(straight),
                                what="converted ZeRO-3 DP2 -> torch_dist -> native DP1")
    print(f"ZeRO-3 DP2 -> converter (torch_dist) -> native DP1 vs uninterrupted: {worst:.2e}")

    weights_only = _copy_of_iteration(tmp / "ck", tmp / "weights_only")
    run_pretrain(1, tiny_gpt_args(tiny_corpus, tmp, *COMMON, *ZERO3, "--load", str(weights_only),
                                  "--no-load-optim", "--metrics-file", str(tmp / "w.jsonl")))
    first = train_curve(tmp / "w.jsonl")[4]
    assert abs(first[0] - straight[4][0]) <= 1e-6 * straight[4][0], (first, straight[4])


def test_zero2_run_refuses_a_zero3_checkpoint(tiny_corpus, zero3_dp2):
    tmp, _ = zero3_dp2
    zero2 = ["--deepspeed", "--deepspeed_config", os.path.join(ROOT, "ds_configs", "zero2.json")]
    code, _, err = run_main(tiny_gpt_args(tiny_corpus, tmp, *COMMON, *zero2, "--load",
                                          str(tmp / "ck")), str(tmp), env())
    assert code == 2, err[-3000:]
    assert "was saved at ZeRO stage 3" in err and "zero3.json" in err
    assert "Traceback" not in err
