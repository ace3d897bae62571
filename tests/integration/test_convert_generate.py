"""Checkpoints in and out, end to end: runs trained at TP1, TP2, PP2, TP2xPP2 and with DeepSpeed
ZeRO-2 (DP2) are exported to Hugging Face and compared with GPT2LMHeadModel (logits, greedy and
beam generation); HF is imported at TP2xPP2 and trained on; resharding round trips are bit
exact and a run resumed at another layout continues with the same losses.

The layouts train on gloo ranks forked from the test process (run_pretrain) and the converter
runs in-process (its main()), since their point is the numbers; tools/generate.py and
tools/evaluate.py run under torchrun, and one refused conversion through the command line."""
import json
import os
import subprocess
import sys

import pytest
import torch

from tests.harness.distributed import run_distributed, run_pretrain
from tests.harness.tools import load_tool, run_tool
from tests.harness.corpus import tiny_gpt_args
from tests.harness.launch import ROOT, assert_close_curves, env, run, train_curve

transformers = pytest.importorskip("transformers")

TRAIN = ["--train-iters", "6", "--log-interval", "1", "--eval-iters", "0", "--lr", "3e-3",
         "--hidden-dropout", "0", "--attention-dropout", "0", "--save-interval", "1000"]
PROMPTS = ["import os\nimport", "def main(argv):\n    ", "class A"]
NEW = 12
TOKENS = torch.tensor([[5, 17, 200, 3, 99, 42, 7, 300, 11, 8, 1, 2],
                       [60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70, 71]])


def _convert(*args):
    run_tool("convert_checkpoint", list(args))


def _train_in_process(argv):
    from pretrain_gpt2 import run as pretrain
    return pretrain(argv)


@pytest.fixture(scope="module")
def runs(tiny_corpus, zero2_dp2_run, tmp_path_factory):
    """Checkpoints (iteration 3 of 6) of the same tiny run at four layouts and TP1's curve; the
    shared DeepSpeed ZeRO-2 DP2 run's checkpoint of iteration 3 as `ds`."""
    tmp = tmp_path_factory.mktemp("layouts")
    args = lambda *extra: tiny_gpt_args(tiny_corpus, tmp, *TRAIN, *extra)  # noqa: E731
    _train_in_process(args("--metrics-file", str(tmp / "straight.jsonl")))
    _train_in_process(args("--save", str(tmp / "tp1"), "--exit-interval", "3"))
    run_pretrain(2, args("--tensor-model-parallel-size", "2", "--save", str(tmp / "tp2"),
                         "--exit-interval", "3"))
    run_pretrain(2, args("--pipeline-model-parallel-size", "2", "--save", str(tmp / "pp2"),
                         "--exit-interval", "3"))
    run_pretrain(4, args("--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                         "--save", str(tmp / "tp2pp2"), "--exit-interval", "3"))
    os.symlink(zero2_dp2_run / "ck", tmp / "ds")
    return {"root": tmp, "corpus": tiny_corpus, "args": args}


def _export(runs, name):
    """The HF export of checkpoint `name`; its format (Megatron at any layout, DeepSpeed ZeRO-2)
    is left to the converter to detect."""
    out = runs["root"] / f"hf_{name}"
    if not out.exists():
        c = runs["corpus"]
        _convert("--output-format", "hf", "--load", runs["root"] / name,
                 "--save", out, "--vocab-file", c["vocab"], "--merge-file", c["merges"],
                 "--iteration", 3)
    return out


def _hf_model(path):
    model, info = transformers.GPT2LMHeadModel.from_pretrained(str(path), output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    return model.eval()


def _rank_outputs(jobs, eod, prompts_ids):
    """On every rank of a TP x PP world: for each (checkpoint, tp, pp) the full-vocab logits of
    TOKENS and greedy generations (last stage's tensor rank 0 returns them)."""
    import torch.distributed as dist
    from app.inference.generation import beam_search, generate
    from app.checkpoint.formats import detect
    from app.inference.runner import PipelineRunner, load_model
    from app.inference.sampling import SamplingConfig
    from app.mpu.parallel_state import initialize_model_parallel
    torch.manual_seed(0)
    results = []
    for load, tp, pp in jobs:
        ps = initialize_model_parallel(tp, pp)
        loaded = load_model(detect(load), ps)
        runner = PipelineRunner(loaded.model, ps, int(loaded.args.hidden_size), torch.device("cpu"))
        positions = torch.arange(TOKENS.shape[1]).unsqueeze(0).expand(TOKENS.shape[0], -1)
        logits = runner.forward(TOKENS, positions)
        pos = int(loaded.args.max_position_embeddings)
        greedy = generate(runner, prompts_ids, NEW, SamplingConfig(greedy=True), eod,
                          loaded.vocab_size, pos)
        recomputed = generate(runner, prompts_ids, NEW, SamplingConfig(greedy=True), eod,
                              loaded.vocab_size, pos, use_cache=False)
        beams = beam_search(runner, prompts_ids[0], NEW, 3, 0.7, eod, loaded.vocab_size, pos)
        keep = ps.is_pipeline_last_stage() and ps.tensor_model_parallel_rank == 0
        results.append({"logits": logits[..., :loaded.vocab_size] if keep else None,
                        "greedy": greedy.tokens, "recomputed": recomputed.tokens,
                        "beam": beams.tokens[0]})
        if dist.is_initialized():
            dist.barrier()
    return results


def _last_stage(outputs):
    return next(o for o in outputs if o["logits"] is not None)


def test_exports_match_hugging_face_at_every_layout(runs):
    """TP1, TP2, PP2, TP2xPP2 and DeepSpeed ZeRO-2 checkpoints -> HF: no missing/unexpected
    weights, HF logits == ours at the checkpoint's own layout, greedy and beam generation equal
    HF generate token for token, the KV cache equals full recomputation, and the text pipeline
    runs offline."""
    from app.data import build_tokenizer
    c = runs["corpus"]
    tok = build_tokenizer("GPT2BPETokenizer", c["vocab"], c["merges"])
    prompts_ids = [tok.tokenize(p) for p in PROMPTS]
    root = runs["root"]
    two = run_distributed(_rank_outputs, 2, [(str(root / "tp2"), 2, 1), (str(root / "pp2"), 1, 2)],
                          tok.eod, prompts_ids, timeout=300)
    four = run_distributed(_rank_outputs, 4, [(str(root / "tp2pp2"), 2, 2)], tok.eod, prompts_ids,
                           timeout=300)
    ours = {"tp1": _rank_outputs([(str(root / "tp1"), 1, 1)], tok.eod, prompts_ids)[0],
            "tp2": _last_stage([r[0] for r in two]), "pp2": _last_stage([r[1] for r in two]),
            "tp2pp2": _last_stage([r[0] for r in four])}
    for name in ("tp1", "tp2", "pp2", "tp2pp2", "ds"):
        hf = _hf_model(_export(runs, name))
        with torch.no_grad():
            hf_logits = hf(TOKENS).logits
        if name in ours:
            torch.testing.assert_close(ours[name]["logits"], hf_logits, rtol=1e-5, atol=1e-5)
            for i, ids in enumerate(prompts_ids):
                want = hf.generate(torch.tensor([ids]), max_new_tokens=NEW, do_sample=False,
                                   eos_token_id=tok.eod, pad_token_id=tok.eod)[0, len(ids):].tolist()
                got = ours[name]["greedy"][i]
                assert got == want[:len(got)], (name, i, got, want)
                assert ours[name]["recomputed"][i] == got
            want = hf.generate(torch.tensor([prompts_ids[0]]), max_new_tokens=NEW, num_beams=3,
                               length_penalty=0.7, do_sample=False, eos_token_id=tok.eod,
                               pad_token_id=tok.eod)[0, len(prompts_ids[0]):].tolist()
            assert ours[name]["beam"] == want[:len(ours[name]["beam"])], name
    # the TP1 export equals the TP2 export's logits (same training, another layout)
    with torch.no_grad():
        torch.testing.assert_close(_hf_model(_export(runs, "tp1"))(TOKENS).logits,
                                   _hf_model(_export(runs, "tp2"))(TOKENS).logits, rtol=1e-4, atol=1e-5)
    # the DeepSpeed export holds the fp32 master weights of iteration 3 (zero_to_fp32's answer)
    _check_ds_export(runs)
    pipe = transformers.pipeline("text-generation", model=str(_export(runs, "tp1")))
    text = pipe("import os", max_new_tokens=5, do_sample=False)[0]["generated_text"]
    assert text.startswith("import os") and len(text) > len("import os")


def _check_ds_export(runs):
    """The ZeRO-2 export against DeepSpeed's own consolidation (its zero_to_fp32 script) and
    against our model built from those weights (logits)."""
    from safetensors.torch import load_file
    from app.checkpoint.hf.families.gpt2 import to_hf_state
    ck = runs["root"] / "ds"
    out = runs["root"] / "ds_fp32"
    if not out.exists():
        run([sys.executable, str(ck / "zero_to_fp32.py"), str(ck), str(out), "--tag", "iter_0000003"],
            runs["root"])
    fp32 = {}  # zero_to_fp32 writes pytorch_model.bin here (safetensors with --safe_serialization)
    for name in os.listdir(out):
        if name.endswith(".safetensors"):
            fp32.update(load_file(str(out / name)))
        elif name.endswith(".bin"):
            fp32.update(torch.load(str(out / name), weights_only=True))
    assert fp32, f"zero_to_fp32 wrote nothing usable in {out}"
    hf_dir = _export(runs, "ds")
    exported = {}
    for name in os.listdir(hf_dir):
        if name.endswith(".safetensors"):
            exported.update(load_file(str(hf_dir / name)))
    want = to_hf_state(fp32, 2, 4, runs["corpus"]["vocab_size"])
    assert set(want) == set(exported)
    for key, value in want.items():
        assert torch.equal(exported[key], value), key


def test_tools_generate_jsonl_at_tp2_equals_hf_greedy(runs):
    """tools/generate.py under torchrun (TP2): --output jsonl gives one object per prompt on
    stdout with the HF-greedy tokens; a prompts file with batched prompts of different lengths."""
    c = runs["corpus"]
    prompts = runs["root"] / "prompts.txt"
    prompts.write_text("\n".join(p.replace("\n", " ") for p in PROMPTS) + "\n")
    out = run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
               os.path.join(ROOT, "tools", "generate.py"), "--load", str(runs["root"] / "tp2"),
               "--vocab-file", c["vocab"], "--merge-file", c["merges"], "--prompts-file", str(prompts),
               "--max-new-tokens", str(NEW), "--greedy", "--output", "jsonl"], runs["root"])
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.strip()]
    assert [r["prompt"] for r in rows] == prompts.read_text().splitlines()
    assert "decode" in out.stderr and "tokens/s" in out.stderr
    hf = _hf_model(_export(runs, "tp2"))
    tok = transformers.AutoTokenizer.from_pretrained(str(_export(runs, "tp2")))
    for row in rows:
        ids = tok(row["prompt"])["input_ids"]
        want = hf.generate(torch.tensor([ids]), max_new_tokens=NEW, do_sample=False,
                           eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id)
        want = want[0, len(ids):].tolist()
        assert row["generated_tokens"] == want[:len(row["generated_tokens"])]
        assert row["generated_text"] == tok.decode([t for t in row["generated_tokens"]
                                                    if t != tok.eos_token_id])


def test_resharding_round_trip_is_bit_exact_with_optimizer(runs):
    """TP1 -> TP2xPP2 -> TP4 -> TP1 (--include-optimizer): every weight, Adam moment, step,
    LR-scheduler state and RNG state comes back bit for bit."""
    from app.checkpoint.legacy import per_rank as ckpt
    root = runs["root"]
    hops = [("tp1", None), ("rt_tp2pp2", (2, 2)), ("rt_tp4", (4, 1)), ("rt_tp1", (1, 1))]
    for (src, _), (dst, (tp, pp)) in zip(hops, hops[1:]):
        _convert("--input-format", "megatron", "--output-format", "megatron", "--load", root / src,
                 "--save", root / dst, "--target-tensor-model-parallel-size", tp,
                 "--target-pipeline-model-parallel-size", pp, "--include-optimizer")
    assert ckpt.saved_layout(str(root / "rt_tp2pp2" / "iter_0000003")) == (2, 2)
    a, _ = ckpt.load_checkpoint_dict(str(root / "tp1"))
    b, it = ckpt.load_checkpoint_dict(str(root / "rt_tp1"))
    assert it == 3
    assert _flatten(a["model"]).keys() == _flatten(b["model"]).keys()
    for key, value in _flatten(a["model"]).items():
        assert torch.equal(value, _flatten(b["model"])[key]), key
    for i, state in a["optimizer"]["state"].items():
        for kind, value in state.items():
            assert torch.equal(value, b["optimizer"]["state"][i][kind]), (i, kind)
    assert a["optimizer"]["param_groups"] == b["optimizer"]["param_groups"]
    assert a["lr_scheduler"] == b["lr_scheduler"]
    assert torch.equal(a["rng_state"][0]["torch_rng_state"], b["rng_state"][0]["torch_rng_state"])
    assert vars(a["args"])["consumed_train_samples"] == vars(b["args"])["consumed_train_samples"]


def _flatten(tree, prefix=""):
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


def test_resume_at_another_layout_continues_the_losses(runs):
    """TP1 checkpoint of iteration 3 -> TP2 with --include-optimizer -> resumed at TP2 for
    iterations 4..6: the losses and grad norms of the uninterrupted TP1 run."""
    root = runs["root"]
    _convert("--input-format", "megatron", "--load", root / "tp1", "--save", root / "tp1_to_tp2",
             "--target-tensor-model-parallel-size", 2, "--include-optimizer")
    metrics = root / "resumed_tp2.jsonl"
    run_pretrain(2, runs["args"]("--tensor-model-parallel-size", "2", "--load",
                                 str(root / "tp1_to_tp2"), "--metrics-file", str(metrics)))
    want = {k: v for k, v in train_curve(root / "straight.jsonl").items() if k > 3}
    assert_close_curves(train_curve(metrics), want, rel=1e-5, what="TP1 -> TP2 resume")


def test_hf_import_at_tp2pp2_matches_hf_and_trains(runs):
    """HF -> Megatron TP2xPP2 (release): evaluate.py's perplexity there equals exp(mean loss)
    of the HF model on the same windows, and a 4-rank run fine-tunes from it with the losses of
    the same fine-tuning at TP1."""
    root, c = runs["root"], runs["corpus"]
    hf_dir = _export(runs, "tp1")
    imported = root / "from_hf_tp2pp2"
    _convert("--input-format", "hf", "--output-format", "megatron", "--load", hf_dir, "--save",
             imported, "--target-tensor-model-parallel-size", 2,
             "--target-pipeline-model-parallel-size", 2, "--make-vocab-size-divisible-by", 64)
    assert (imported / "latest_checkpointed_iteration.txt").read_text() == "release"
    text = root / "eval.txt"
    text.write_text(open(os.path.join(os.path.dirname(os.__file__), "textwrap.py")).read()[:4000])
    out = run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
               os.path.join(ROOT, "tools", "evaluate.py"), "--load", str(imported), "--task",
               "wikitext", "--valid-data", str(text), "--vocab-file", c["vocab"],
               "--merge-file", c["merges"], "--overlapping-eval", "16", "--no-detokenize"], root)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    hf = _hf_model(hf_dir)
    tok = transformers.AutoTokenizer.from_pretrained(str(hf_dir))
    ids = tok(text.read_text())["input_ids"]
    seq, stride, losses = 32, 16, []
    with torch.no_grad():  # independent of app.eval: window i starts at i*stride and scores
        for start in range(0, len(ids), stride):  # its last `stride` targets (all, if i == 0)
            window = torch.tensor(ids[start:start + seq + 1])
            nll = torch.nn.functional.cross_entropy(hf(window[None, :-1]).logits[0], window[1:],
                                                    reduction="none")
            losses.append(nll if start == 0 else nll[seq - stride:])
            if start + seq + 1 >= len(ids):
                break
    losses = torch.cat(losses)
    assert result["scored_tokens"] == len(ids) - 1 == losses.numel()
    assert result["ppl"] == pytest.approx(float(torch.exp(losses.mean())), rel=1e-5)
    tuned_tp1, tuned_4 = root / "tuned_tp1.jsonl", root / "tuned_tp2pp2.jsonl"
    _train_in_process(runs["args"]("--load", str(root / "tp1"), "--finetune", "--train-iters", "2",
                                   "--metrics-file", str(tuned_tp1)))
    run_pretrain(4, runs["args"]("--tensor-model-parallel-size", "2",
                                 "--pipeline-model-parallel-size", "2", "--load", str(imported),
                                 "--train-iters", "2", "--metrics-file", str(tuned_4)))
    assert_close_curves(train_curve(tuned_4), train_curve(tuned_tp1), rel=1e-5, what="HF import")


def _transformers_gpt2_directory(corpus, path):
    """A GPT-2 directory as transformers writes it today: GPT2LMHeadModel and GPT2TokenizerFast
    (the corpus' vocabulary and merges) through their own save_pretrained, which writes the
    tokenizer as tokenizer.json alone."""
    tok = transformers.GPT2TokenizerFast(vocab=corpus["vocab"], merges=corpus["merges"])
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=len(tok), n_positions=32, n_embd=64, n_layer=2,
                                     n_head=4, bos_token_id=tok.eos_token_id,
                                     eos_token_id=tok.eos_token_id)
    transformers.GPT2LMHeadModel(config).save_pretrained(str(path))
    tok.save_pretrained(str(path))
    return path


def test_transformers_gpt2_fine_tunes_with_either_tokenizer_flags(tiny_corpus, tmp_path):
    """transformers' own GPT-2 directory (tokenizer.json, no vocab.json/merges.txt) imported at
    TP2 fine-tunes with GPT2BPETokenizer files of the same vocabulary and with
    HuggingFaceTokenizer of the directory, to the same losses; another vocabulary of the same
    size is refused, naming the flags that load the checkpoint. The three runs share one
    2-rank spawn."""
    from app.data.tokenizer import train_gpt2_bpe
    from tests.harness.corpus import stdlib_texts
    from tests.harness.distributed import run_pretrain_each
    hf_dir = _transformers_gpt2_directory(tiny_corpus, tmp_path / "gpt2")
    assert not (hf_dir / "vocab.json").exists() and (hf_dir / "tokenizer.json").exists()
    imported = tmp_path / "gpt2_tp2"
    _convert("--input-format", "hf", "--load", hf_dir, "--save", imported,
             "--target-tensor-model-parallel-size", 2, "--make-vocab-size-divisible-by", 64)
    other_vocab, other_merges = train_gpt2_bpe(stdlib_texts(80)[40:], tiny_corpus["vocab_size"],
                                               str(tmp_path / "other"))
    gpt2_flags = ["--vocab-file", tiny_corpus["vocab"], "--merge-file", tiny_corpus["merges"]]
    hf_flags = ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(hf_dir)]
    other_flags = ["--vocab-file", other_vocab, "--merge-file", other_merges]

    def argv(tokenizer, name):
        plain = tiny_gpt_args(tiny_corpus, tmp_path, *TRAIN, "--train-iters", "2",
                              "--tensor-model-parallel-size", "2", "--load", str(imported),
                              "--metrics-file", str(tmp_path / f"{name}.jsonl"))
        cut = plain.index("--vocab-file")
        return plain[:cut] + plain[cut + 4:] + tokenizer

    (gpt2, hf, other), _ = run_pretrain_each(2, [argv(gpt2_flags, "gpt2"), argv(hf_flags, "hf"),
                                                 argv(other_flags, "other")])
    assert gpt2[0] and hf[0], (gpt2[1] if not gpt2[0] else hf[1])[-3000:]
    saved = f"--tokenizer-type HuggingFaceTokenizer --tokenizer-model {hf_dir}"
    assert (f"tokenizer: this run's --tokenizer-type GPT2BPETokenizer --vocab-file "
            f"{tiny_corpus['vocab']} --merge-file {tiny_corpus['merges']} is the checkpoint's "
            f"{saved}: the same vocabulary, merges and end-of-document token") in gpt2[1]
    curves = [train_curve(tmp_path / f"{name}.jsonl") for name in ("gpt2", "hf")]
    assert sorted(curves[0]) == [1, 2] and curves[0] == curves[1]  # the same ids: bit for bit
    assert not other[0]
    assert (f"CheckpointError: checkpoint was saved with tokenizer {saved} but this run uses "
            f"--tokenizer-type GPT2BPETokenizer --vocab-file {other_vocab} --merge-file "
            f"{other_merges}, and it is not the same tokenizer (token ") in other[1], other[1]
    assert f"to load it pass {saved} (or --tokenizer-type GPT2BPETokenizer" in other[1]


def test_converter_errors_are_clear(runs, tmp_path, capsys):
    """The command line refuses a non-empty --save with exit 2 and one line, no traceback;
    main() (in-process) refuses a tensor-parallel size the heads do not divide, writing nothing,
    and prints a checkpoint's structure."""
    root = runs["root"]
    bad = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "convert_checkpoint.py"),
                          "--input-format", "megatron", "--load", str(root / "tp1"), "--save",
                          str(root / "tp1"), "--target-tensor-model-parallel-size", "3"],
                         capture_output=True, text=True, env=env(), timeout=120)
    assert bad.returncode == 2 and "not empty" in bad.stderr and "Traceback" not in bad.stderr
    convert = load_tool("convert_checkpoint")
    capsys.readouterr()
    code = convert.main(["--input-format", "megatron", "--load", str(root / "tp1"), "--save",
                         str(tmp_path / "x"), "--target-tensor-model-parallel-size", "3"])
    err = capsys.readouterr().err
    assert code == 2 and "num_attention_heads (4)" in err, err
    assert not (tmp_path / "x").exists() and not any(p.name.startswith(".x") for p in tmp_path.iterdir())
    code = convert.main(["--input-format", "megatron", "--load", str(root / "tp2pp2"),
                         "--print-checkpoint-structure"])
    shown = capsys.readouterr()
    assert code == 0, shown.err
    assert "TP 2, PP 2" in shown.out and "word_embeddings_for_head" in shown.out
    assert "query_key_value.weight: tensor [96, 64] float32" in shown.out


def _greedy_reproduces(hf, context_ids, target_ids):
    """HF: is every target token the argmax after the context and the targets before it?"""
    ids = torch.tensor([context_ids + target_ids])
    with torch.no_grad():
        predicted = hf(ids).logits[0].argmax(-1)
    first = len(context_ids) - 1
    return predicted[first:first + len(target_ids)].tolist() == target_ids


def test_lambada_accuracy_on_a_hand_made_file(runs, tmp_path, capsys):
    """A hand-made file of passages: for each context, one ending with the model's greedy next
    token (known right) and one with its second choice (known wrong). tools/evaluate.py scores
    exactly the right ones; --strict-lambada (whole last word) agrees with HF's argmax."""
    hf_dir = _export(runs, "tp1")
    hf, tok = _hf_model(hf_dir), transformers.AutoTokenizer.from_pretrained(str(hf_dir))
    source = open(os.path.join(os.path.dirname(os.__file__), "textwrap.py")).read().splitlines()
    rows, correct = [], 0
    for line in [ln for ln in source if len(ln.strip()) > 12][:40]:
        context = line.rstrip()
        ids = tok(context)["input_ids"]
        if len(ids) >= 30:  # the model has 32 positions
            continue
        with torch.no_grad():
            order = hf(torch.tensor([ids])).logits[0, -1].argsort(descending=True)[:2].tolist()
        texts = [context + tok.decode([t]) for t in order]
        if any(tok(t)["input_ids"] != ids + [o] for t, o in zip(texts, order)):
            continue  # the ending must tokenize to exactly that token
        rows += texts
        correct += 1
    assert correct >= 3, f"only {correct} usable passages"
    data = tmp_path / "lambada.jsonl"
    data.write_text("".join(json.dumps({"text": r}) + "\n" for r in rows))
    tool = load_tool("evaluate")
    assert tool.main(["--load", str(hf_dir), "--task", "lambada", "--valid-data", str(data),
                      "--results-file", str(tmp_path / "r.json")]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (result["correct"], result["total"]) == (correct, len(rows))
    assert json.loads((tmp_path / "r.json").read_text())["accuracy"] == correct / len(rows)
    strict_want = 0
    for text in rows:
        last = text.split()[-1]
        context = tok(text[:text.rfind(last)].strip())["input_ids"]
        strict_want += _greedy_reproduces(hf, context, tok(" " + last)["input_ids"])
    assert tool.main(["--load", str(hf_dir), "--task", "lambada", "--valid-data", str(data),
                      "--strict-lambada"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["correct"] == strict_want


def test_http_server_generates_and_rejects_bad_requests(runs):
    """A real HTTP server on a free port: PUT and POST /api return text (greedy == the library's
    generate), seeded sampling is reproducible; bad JSON, unknown fields, bad sampling values and
    over-long prompts get 400 and the server keeps serving."""
    import threading
    import urllib.error
    import urllib.request
    from werkzeug.serving import make_server
    from app.inference.server import create_app
    from app.inference.session import InferenceSession
    session = InferenceSession(str(_export(runs, "tp1")))
    server = make_server("127.0.0.1", 0, create_app(session, max_batch=4), threaded=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{server.server_port}/api"

    def call(body, method="PUT", raw=None):
        data = raw if raw is not None else json.dumps(body).encode()
        req = urllib.request.Request(url, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=60) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as err:
            return err.code, json.loads(err.read())

    try:
        status, body = call({"prompts": PROMPTS[:2], "tokens_to_generate": 6})
        assert status == 200 and len(body["text"]) == 2
        assert body["text"][0].startswith(PROMPTS[0]) and body["decode_tokens_per_s"] > 0
        ids = [session.tokenizer.tokenize(p) for p in PROMPTS[:2]]
        from app.inference.generation import generate
        from app.inference.sampling import SamplingConfig
        want = generate(session.runner, ids, 6, SamplingConfig(greedy=True), session.tokenizer.eod,
                        session.vocab_size, session.max_positions).tokens
        assert body["generated_tokens"] == want
        sampled = {"prompts": ["x = "], "tokens_to_generate": 8, "top_p": 0.9, "temperature": 0.9,
                   "random_seed": 7}
        assert call(sampled, "POST")[1]["generated_tokens"] == call(sampled)[1]["generated_tokens"]
        short = {"prompts": ["x"], "tokens_to_generate": 2}
        bad = [(None, b"{not json", "not valid JSON"), ({"prompts": "x"}, None, "prompts"),
               ({**short, "foo": 1}, None, "unknown field 'foo'"),
               ({**short, "top_p": 1.5}, None, "top_p"), ({**short, "temperature": 0}, None, "temperature"),
               ({**short, "tokens_to_generate": "5"}, None, "tokens_to_generate"),
               ({"prompts": ["x " * 40], "tokens_to_generate": 4}, None, "positions"),
               ({**short, "prompts": ["a"] * 5}, None, "batch limit"),
               ({**short, "beam_width": 2, "top_k": 5}, None, "beam search")]
        for body_, raw, why in bad:
            status, reply = call(body_, raw=raw)
            assert status == 400 and why in reply["error"], (body_, raw, reply)
        status, body = call({"prompts": ["def"], "tokens_to_generate": 3, "beam_width": 2})
        assert status == 200 and body["text"][0].startswith("def")
    finally:
        server.shutdown()
        thread.join(timeout=10)
