"""Megatron-LM's own code reads our torch_dist checkpoints, and we read its (torch_dist and the
legacy --ckpt-format torch).

Megatron's side (megatron_side.py) runs Megatron Core from the installed megatron-core
(requirements-test.txt), or from a Megatron-LM checkout when MEGATRON_LM names one (and
MEGATRON_PYTHON, when given, the Python with its dependencies).

Each check runs for GPT-2, for a Llama-style model (--swiglu, RMSNorm, --disable-bias-linear
with Qwen2's --add-qkv-bias, --qk-layernorm, RoPE with Llama 3.1's --use-rope-scaling at
Megatron's GPT builder's factor 8, grouped-query attention with 2 groups, untied output layer)
and for that model with Mixture of Experts in every layer (4 experts, top-2: Megatron Core
0.16.1's MoE GPTModel, SequentialMLP experts, allgather dispatcher), all in the same processes:

- ours -> Megatron: a run saved at TP2 x PP2 (the MoE model: TP2 with sequence parallelism x
  EP2, its experts split over the expert-tensor ranks too) on 4 ranks, after 3 steps, with its
  optimizer, is loaded by Megatron Core's dist_checkpointing.load into its GPTModel built with
  the local spec at TP1 (strict: every key Megatron asks for exists, no key it does not), and
  Megatron's logits equal ours (1e-5).
- Megatron -> ours: a GPTModel saved the way Megatron-LM saves, with the args Megatron-LM's own
  parse_args made for the same flags (tests/data/megatron_args: num_query_groups 1 without
  --group-query-attention, ...; the Llama model: the swiglu_rmsnorm flags with QK-norm, RoPE,
  2 groups and untied set on top; the MoE model: the qwen3_moe flags with the same on top),
  resumes here (--finetune): the torch_dist save at TP2 (the MoE model at EP2) on two ranks and
  the legacy mp_rank_00/model_optim_rng.pt (the MoE model's local experts one key each) at TP1,
  with Megatron's logits.
"""
import json
import os
import subprocess
import sys

import pytest
import torch

from tests.harness.distributed import run_distributed, run_main
from tests.harness.launch import ROOT, env

MEGATRON = os.environ.get("MEGATRON_LM")
PYTHON = os.environ.get("MEGATRON_PYTHON", sys.executable)
SIDE = os.path.join(ROOT, "tests", "harness", "megatron_side.py")
VOCAB = 320  # tests/data/old_checkpoints/data/vocab.json, as in the recorded Megatron args
ARGV = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "2",
        "--global-batch-size", "4", "--train-iters", "6", "--lr", "1e-2", "--hidden-dropout", "0",
        "--attention-dropout", "0", "--make-vocab-size-divisible-by", "8",
        "--distributed-backend", "gloo", "--ckpt-format", "torch_dist"]
LLAMA = ["--swiglu", "--normalization", "RMSNorm", "--disable-bias-linear", "--add-qkv-bias",
         "--qk-layernorm", "--position-embedding-type", "rope", "--rotary-base", "1000000",
         "--use-rope-scaling", "--group-query-attention", "--num-query-groups", "2",
         "--untie-embeddings-and-output-weights"]
MODELS = {"gpt2": [], "llama": LLAMA,
          "moe": LLAMA + ["--num-experts", "4", "--moe-ffn-hidden-size", "16", "--moe-router-topk",
                          "2", "--moe-aux-loss-coeff", "1e-2"]}
"""Our flags of each model megatron_side.py builds (`write FORMAT MODEL=DIR`)."""
TP2 = ["--tensor-model-parallel-size", "2"]
SAVED_AT = {"gpt2": TP2 + ["--pipeline-model-parallel-size", "2"],
            "llama": TP2 + ["--pipeline-model-parallel-size", "2"],
            "moe": TP2 + ["--sequence-parallel", "--expert-model-parallel-size", "2"]}
"""The 4-rank layout each model's checkpoint for Megatron is saved at."""
READ_AT = {"gpt2": TP2, "llama": TP2, "moe": ["--expert-model-parallel-size", "2"]}
"""The 2-rank layout each model reads Megatron's checkpoint at."""


def megatron(*args, cwd):
    """megatron_side.py under Megatron Core (installed, or MEGATRON_LM's checkout); its output,
    after checking it exited 0."""
    path = os.pathsep.join(p for p in (MEGATRON, ROOT) if p)
    proc = subprocess.run([PYTHON, SIDE, *args], capture_output=True, text=True, cwd=cwd,
                          env=dict(env(), PYTHONPATH=path), timeout=600)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc.stdout


def megatron_each(commands, cwd):
    """megatron() of several commands (each a list: `write ...`, `read ...`) in one process."""
    joined = [arg for i, command in enumerate(commands) for arg in ["+"] * (i > 0) + command]
    return megatron(*joined, cwd=cwd)


def _build(flags, world):
    import arguments
    from tests.harness.synthetic import build_synthetic_run
    return build_synthetic_run(arguments.config_from_argv(ARGV + flags, world, VOCAB), VOCAB)


def _logits(run, tokens):
    model = run["model"]
    model.eval()
    with torch.no_grad():
        return model(tokens, torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens))


def _save_tp2_pp2(base):
    for model, flags in MODELS.items():
        run = _build(flags + SAVED_AT[model], 4)
        for _ in range(3):
            run["trainer"].train_step(run["iterator"])
        run["engine"].save_checkpoint(f"{base}/{model}", 3, dict(
            iteration=3, consumed_train_samples=12, consumed_valid_samples=0))


def test_megatron_reads_our_tp2_pp2_checkpoint(tmp_path):
    run_distributed(_save_tp2_pp2, 4, str(tmp_path), timeout=300)
    tokens = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    for model, flags in MODELS.items():
        ours = str(tmp_path / model)
        loaded = _build(flags + ["--load", ours, "--finetune"], 1)
        loaded["engine"].load_checkpoint(ours)
        torch.save({"tokens": tokens, "logits": _logits(loaded, tokens)}, f"{ours}/probe.pt")
    print(megatron("read", *(str(tmp_path / model) for model in MODELS), cwd=tmp_path))


def _read_at_tp2(base):
    """{model: max |our logits - Megatron's|} of this rank's vocabulary part, each model's
    checkpoint in `base` loaded at its READ_AT layout (TP2; the MoE model EP2)."""
    diffs = {}
    for model, flags in MODELS.items():
        directory = f"{base}/{model}"
        run = _build(flags + READ_AT[model] + ["--load", directory, "--finetune"], 2)
        run["engine"].load_checkpoint(directory)
        probe = torch.load(f"{directory}/probe.pt")
        mine = _logits(run, probe["tokens"])  # [b, s, V/tp]: this rank's part of the vocabulary
        width, tp_rank = mine.shape[-1], run["ps"].tensor_model_parallel_rank
        want = probe["logits"][..., tp_rank * width:(tp_rank + 1) * width]
        diffs[model] = (mine - want).abs().max().item()
    return diffs


@pytest.fixture(scope="module")
def megatrons_checkpoints(tmp_path_factory):
    """{format: folder}: megatron_side.py's `write` of every model of MODELS into
    folder/<model>, in Megatron's torch_dist and legacy torch formats (one process: Megatron
    Core imported once). The tests only read them."""
    base = tmp_path_factory.mktemp("megatrons_checkpoints")
    folders = {fmt: base / fmt for fmt in ("torch_dist", "torch")}
    for folder in folders.values():
        for model in MODELS:
            os.makedirs(folder / model)
    print(megatron_each([["write", fmt, *(f"{m}={folder / m}" for m in MODELS)]
                         for fmt, folder in folders.items()], cwd=base))
    return {fmt: str(folder) for fmt, folder in folders.items()}


def test_we_read_megatrons_checkpoint_at_tp2(megatrons_checkpoints):
    diffs = run_distributed(_read_at_tp2, 2, megatrons_checkpoints["torch_dist"], timeout=300)
    assert all(d < 1e-5 for rank in diffs for d in rank.values()), diffs


def test_we_read_megatrons_legacy_checkpoint(megatrons_checkpoints):
    """Megatron-LM's --ckpt-format torch save of Megatron Core's GPTModel (its flat
    state_dict_for_save_checkpoint, Megatron's pickled args with their enums) loads here."""
    for model, flags in MODELS.items():
        theirs = f"{megatrons_checkpoints['torch']}/{model}"
        assert os.path.isfile(f"{theirs}/iter_0000003/mp_rank_00/model_optim_rng.pt")
        run = _build(flags + ["--ckpt-format", "torch", "--load", theirs, "--finetune"], 1)
        run["engine"].load_checkpoint(theirs)
        probe = torch.load(f"{theirs}/probe.pt")
        assert (_logits(run, probe["tokens"]) - probe["logits"]).abs().max().item() < 1e-5, model


# ---------------------------------------------------------------- a Megatron run continues here

DATA = os.path.join(ROOT, "tests", "data", "old_checkpoints", "data")


def _reversed_corpus(prefix):
    """A second dataset for the blend: the corpus's documents in reverse order, written by
    Megatron Core's own IndexedDatasetBuilder."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
    source = IndexedDataset(f"{DATA}/corpus_text_document")
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=source.index.dtype)
    for i in reversed(range(len(source.document_indices) - 1)):
        first, last = source.document_indices[i], source.document_indices[i + 1]
        for j in range(first, last):
            builder.add_item(torch.from_numpy(source[j].astype("int64")))
        builder.end_document()
    builder.finalize(f"{prefix}.idx")


RUNS = {"torch_dist-one_dataset": ("torch_dist", False),
        "torch_dist-blend_0.3_0.7": ("torch_dist", True),
        "torch-one_dataset": ("torch", False)}
"""The Megatron runs that continue here: {name: (checkpoint format, blend of two datasets)}."""


@pytest.fixture(scope="module")
def megatron_runs(tmp_path_factory):
    """{name of RUNS: (folder, --data-path)}: iteration 3 of each run written by megatron_side.py
    (one process) into folder/theirs, with the losses Megatron gives the global batches after
    it (folder/theirs/megatron_losses.json); the blend's second dataset is the corpus reversed."""
    base = tmp_path_factory.mktemp("megatron_runs")
    runs, commands = {}, []
    for name, (ckpt_format, blend) in RUNS.items():
        folder = base / name
        os.makedirs(folder / "theirs")
        data_path = [f"{DATA}/corpus_text_document"]
        if blend:
            _reversed_corpus(str(folder / "reversed_text_document"))
            data_path = ["0.3", data_path[0], "0.7", str(folder / "reversed_text_document")]
        commands.append(["write", ckpt_format, f"gpt2={folder / 'theirs'}", "100,0,0",
                         *data_path])
        runs[name] = (str(folder), data_path)
    print(megatron_each(commands, cwd=base))
    return runs


@pytest.mark.parametrize("name", list(RUNS))
def test_a_megatron_run_continues_here_with_megatrons_losses(name, megatron_runs, tmp_path):
    """The issue's done-when: Megatron Core's own code writes iteration 3 of a run (its
    GPTModel, the args its parse_args made); pretrain_gpt2.py resumes it with --no-load-optim
    and --lr 0, and the losses it logs at iterations 4-6 equal the losses Megatron's model gives
    on the global batches Megatron would feed next (its dataset builder and GPTDataset, its
    loss averaging), to 1e-5; from its torch_dist checkpoint and from its legacy files. The
    command line runs in a child forked with the trainer imported (run_main), not a new
    interpreter: its numbers are the point."""
    from tests.harness.corpus import read_metrics
    folder, data_path = megatron_runs[name]
    ckpt_format, theirs = RUNS[name][0], f"{folder}/theirs"
    with open(f"{theirs}/megatron_losses.json") as f:
        expected = json.load(f)
    metrics = str(tmp_path / "metrics.jsonl")
    flags = [a for a in ARGV if a not in ("--lr", "1e-2")]
    code, out, err = run_main(
        [*flags, "--lr", "0", "--min-lr", "0", "--seed", "1234", "--log-interval", "1",
         "--eval-iters", "0", "--data-path", *data_path, "--split", "100,0,0", "--vocab-file",
         f"{DATA}/vocab.json", "--merge-file", f"{DATA}/merges.txt", "--data-cache-path",
         str(tmp_path / "cache"), "--num-workers", "0", "--ckpt-format", ckpt_format, "--load",
         theirs, "--no-load-optim", "--metrics-file", metrics], tmp_path, env())
    assert code == 0, f"{out[-3000:]}\n{err[-5000:]}"
    ours = {str(r["iteration"]): r["lm_loss"] for r in read_metrics(metrics)
            if r["kind"] == "train"}
    assert sorted(ours) == ["4", "5", "6"], ours
    for iteration, loss in expected.items():
        assert ours[iteration] == pytest.approx(loss, abs=1e-5), (iteration, ours, expected)
