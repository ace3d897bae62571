"""pretrain_gpt2.py --mock-data beyond one process: under DeepSpeed (ZeRO-1) at TP2, where
tensor-parallel rank 0 reads the synthetic samples and broadcasts them, the run gives the
losses and gradient norms of one native process (fp32, dropout 0; no data file and no
tokenizer file anywhere). One launch: the samples reach the model through the same sampler and
batch builder at every layout and on both engines. The two ranks are forked
(tests.harness.distributed.run_pretrain), not launched: the point is the numbers."""
import os

from tests.harness.distributed import run_pretrain
from tests.harness.launch import assert_close_curves, train_curve

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ARGS = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "2",
        "--global-batch-size", "4", "--train-iters", "4", "--lr", "1e-3", "--log-interval", "1",
        "--eval-iters", "0", "--hidden-dropout", "0", "--attention-dropout", "0",
        "--mock-data", "--vocab-size", "96", "--make-vocab-size-divisible-by", "16",
        "--distributed-backend", "gloo"]  # padded to 96 at TP1 and TP2 alike


def test_mock_data_under_deepspeed_at_tp2_trains_as_one_process(tmp_path):
    from pretrain_gpt2 import run
    one, zero1 = tmp_path / "one.jsonl", tmp_path / "zero1.jsonl"
    run(ARGS + ["--metrics-file", str(one)])
    run_pretrain(2, ARGS + ["--tensor-model-parallel-size", "2", "--deepspeed",
                            "--deepspeed_config", os.path.join(ROOT, "ds_configs", "zero1.json"),
                            "--metrics-file", str(zero1)])
    reference = train_curve(one)
    assert len(reference) == 4 and 4.0 < reference[1][0] < 5.0  # ~ln(96): random tokens
    assert_close_curves(train_curve(zero1), reference, what="--mock-data DeepSpeed ZeRO-1 TP2")
