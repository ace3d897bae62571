"""The custom-loss entry point (app.training.loss) and return_logits, in one process.

- examples/custom_loss.py's loss equals PyTorch's label-smoothed cross-entropy (an independent
  implementation) plus the z-loss formula;
- with no smoothing and no z-loss, training with it (on the logits path) gives the default
  run's losses and gradient norms, and its metrics come back averaged;
- the default loss never materialises logits (the fast path is kept);
- return_logits hands back each micro-batch's full-vocabulary logits, whose masked
  cross-entropy is the step's loss.
"""
from __future__ import annotations

import importlib.util
import pathlib

import pytest
import torch
import torch.nn.functional as F

import arguments
from app.training import loss as loss_lib
from tests.harness.synthetic import build_synthetic_run

ROOT = pathlib.Path(__file__).resolve().parents[2]
ARGV = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "4",
        "--train-iters", "3", "--lr", "1e-3", "--hidden-dropout", "0", "--attention-dropout", "0",
        "--make-vocab-size-divisible-by", "8", "--peak-flops", "1e12",
        "--distributed-backend", "gloo", "--eod-mask-loss"]


def _example():
    spec = importlib.util.spec_from_file_location("custom_loss_example",
                                                  ROOT / "examples" / "custom_loss.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(loss_function=None, return_logits=False, iters=3):
    cfg = arguments.config_from_argv(ARGV, 1, 60)
    run = build_synthetic_run(cfg, 4 * iters, loss_function=loss_function,
                              return_logits=return_logits)
    return run, [run["trainer"].train_step(run["iterator"]) for _ in range(iters)]


def test_example_loss_is_label_smoothed_cross_entropy_plus_z_loss():
    example = _example()
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 11, generator=gen)
    labels = torch.randint(0, 11, (2, 5), generator=gen)
    mask = torch.tensor([[1.0, 1, 0, 1, 1], [1, 1, 1, 1, 0]])
    batch = {"labels": labels, "loss_mask": mask}
    for eps, z in ((0.0, 0.0), (0.1, 0.0), (0.3, 1e-2)):
        got, metrics = example.smoothed_loss_with_z_loss(eps, z).fn(logits, batch)
        per_token = F.cross_entropy(logits.view(-1, 11), labels.view(-1), reduction="none",
                                    label_smoothing=eps).view(2, 5)
        z_term = (torch.logsumexp(logits, -1) ** 2 * mask).sum() / mask.sum()
        want = (per_token * mask).sum() / mask.sum() + z * z_term
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(metrics["z_loss"], z_term)
    with pytest.raises(ValueError, match="--label-smoothing"):
        example.smoothed_loss_with_z_loss(1.0, 0.0)
    with pytest.raises(ValueError, match="inputs"):
        loss_lib.LossFunction(lambda o, b: (o, {}), inputs="hidden")


def test_logits_loss_trains_like_the_default_and_reports_metrics(monkeypatch):
    _, default = _run()
    plain = _example().smoothed_loss_with_z_loss(0.0, 0.0)
    _, custom = _run(plain)
    for d, c in zip(default, custom):
        assert c.loss == pytest.approx(d.loss, rel=1e-6)
        assert c.grad_norm == pytest.approx(d.grad_norm, rel=1e-5)
        assert d.metrics == {}
        assert set(c.metrics) == {"cross entropy", "z_loss"}
        assert c.metrics["cross entropy"] == pytest.approx(d.loss, rel=1e-6)
    # the default path asks the model for the per-token loss: no logits, no gather
    def no_logits(*args, **kwargs):
        raise AssertionError("the default loss must not take the logits path")
    monkeypatch.setattr(loss_lib, "gather_from_tensor_model_parallel_region", no_logits)
    monkeypatch.setattr(loss_lib, "lm_loss", no_logits)
    _run(iters=1)


def test_return_logits_hands_back_each_micro_batch():
    """Each step's logits [b, s, V] (detached), one per micro-batch, reproduce its loss."""
    cfg = arguments.config_from_argv(ARGV, 1, 60)
    run = build_synthetic_run(cfg, 16, return_logits=True)
    trainer, seen = run["trainer"], []
    draw = trainer.batches.next
    trainer.batches.next = lambda iterator: seen.append(draw(iterator)) or seen[-1]
    vocab = cfg.model.padded_vocab_size
    for step in (trainer.train_step, trainer.eval_step, trainer.train_step):
        seen.clear()
        out = step(run["iterator"])
        logits = out.logits
        assert len(logits) == 2 == len(seen)
        assert all(t.shape == (2, 16, vocab) and not t.requires_grad for t in logits)
        losses = [loss_lib.masked_mean_loss(
            F.cross_entropy(t.view(-1, vocab), b["labels"].view(-1), reduction="none"),
            b["loss_mask"].view(-1)) for t, b in zip(logits, seen)]
        assert out.loss == pytest.approx(torch.stack(losses).mean().item(), rel=1e-6)


class _Rows:
    """A data set of fixed token rows ({"text": [s + 1]})."""

    def __init__(self, rows: torch.Tensor) -> None:
        self.rows = rows.numpy()

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int):
        return {"text": self.rows[i]}


def _per_token_rows() -> torch.Tensor:
    """4 samples of 17 tokens: the first micro-batch (samples 0, 1) has one end-of-document
    token (id 0, masked out by --eod-mask-loss), the second eleven: uneven token counts."""
    rows = torch.randint(1, 60, (4, 17), generator=torch.Generator().manual_seed(5))
    rows[0, 3] = 0
    rows[2, ::3] = 0
    rows[3, 1:9:2] = 0
    return rows


@pytest.mark.parametrize("per_token", [True, False])
def test_per_token_loss_is_the_global_batch_sum_over_its_token_count(per_token):
    """--calculate-per-token-loss against a hand computation: the gradient and the logged loss
    of sum(masked token losses of both micro-batches) / their token count; without the flag,
    the mean of the two micro-batches' masked means (different here: uneven counts)."""
    from app.data import get_batch
    from app.model import GPT2Model
    from app.training.data_loading import build_data_iterator
    from app.training.run import build_run
    flags = ["--calculate-per-token-loss"] if per_token else []
    cfg = arguments.config_from_argv(ARGV + flags + ["--clip-grad", "0"], 1, 60)  # grads as made
    run = build_run(cfg, 1, torch.device("cpu"))
    rows = _per_token_rows()
    data = _Rows(rows)
    trainer = run.attach_trainer((data, None, None), eod=0)
    step = trainer.train_step(build_data_iterator(data, 0, 2, run.ps, 0))

    reference = GPT2Model(cfg.model)  # the same initial weights (drawn from their names)
    batches = [get_batch(rows[i:i + 2], 0, False, False, True) for i in (0, 2)]
    sums = [(reference(b["tokens"], b["position_ids"], labels=b["labels"]) * b["loss_mask"]).sum()
            for b in batches]
    counts = [b["loss_mask"].sum() for b in batches]
    assert counts[0] != counts[1]
    if per_token:
        loss = (sums[0] + sums[1]) / (counts[0] + counts[1])
    else:
        loss = (sums[0] / counts[0] + sums[1] / counts[1]) / 2
    loss.backward()
    assert step.loss == pytest.approx(loss.item(), rel=1e-6)
    grads = dict(run.model.named_parameters())
    for name, param in reference.named_parameters():
        torch.testing.assert_close(grads[name].grad, param.grad, rtol=1e-5, atol=1e-7,
                                   msg=lambda m, n=name: f"{n}: {m}")
    other = (sums[0] / counts[0] + sums[1] / counts[1]) / 2 if per_token else \
        (sums[0] + sums[1]) / (counts[0] + counts[1])
    assert abs(other.item() - loss.item()) > 1e-3  # the two normalisations differ here


def test_per_token_loss_refuses_a_custom_loss():
    with pytest.raises(ValueError, match="--calculate-per-token-loss normalises"):
        cfg = arguments.config_from_argv(ARGV + ["--calculate-per-token-loss"], 1, 60)
        build_synthetic_run(cfg, 4, loss_function=loss_lib.LossFunction(
            lambda out, batch: (out.mean(), {})))
