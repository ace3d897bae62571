"""lm-evaluation-harness on our checkpoints: the `megatron_gpt2` model type scores three local
tasks (multiple choice, rolling perplexity, generation) exactly as lm_eval's own `hf` backend
scores the exported Hugging Face model: the same answers and accuracy, the same generated text,
perplexities within 1e-4 (relative) — at TP1 in this process, at TP2 with the other rank spawned
from --model_args, and under torchrun. Nothing is downloaded (the tasks read local JSONL)."""
import glob
import json
import os
import sys

import pytest

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from tests.harness.tools import run_tool  # noqa: E402
from tests.harness.corpus import tiny_gpt_args  # noqa: E402
from tests.harness.launch import ROOT, run  # noqa: E402

lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is not installed: pip install lm-eval")

TASKS = ["tiny_choice", "tiny_rolling", "tiny_until"]
TRAIN = ["--train-iters", "8", "--log-interval", "4", "--eval-iters", "0", "--lr", "3e-3",
         "--hidden-dropout", "0", "--attention-dropout", "0", "--save-interval", "1000"]


def _task_yaml(name, data, output_type, extra):
    return "\n".join([
        f"task: {name}", "dataset_path: json",
        f"dataset_kwargs: {{data_files: {{test: {data}}}}}",
        "test_split: test", f"output_type: {output_type}", *extra]) + "\n"


def _write_tasks(root, texts):
    """Three tasks over snippets of Python source (what the tiny model was trained on)."""
    docs = {"choice": [], "rolling": [], "until": []}
    for i, text in enumerate(texts):
        lines = [line.strip() for line in text.splitlines()
                 if len(line.split()) >= 3 and len(line) < 60 and len(line.split()[-1]) < 12][:4]
        for line in lines:
            words = line.split()
            context, answer = " ".join(words[:-1]), words[-1]
            wrong = ["import", "return", "(self)", "None", "0"][(i + len(words)) % 5]
            docs["choice"].append({"context": context, "choices": [answer, wrong, "elif"],
                                   "label": len(docs["choice"]) % 3})
            docs["until"].append({"prompt": line[:len(line) // 2], "answer": line[len(line) // 2:]})
        docs["rolling"].append({"text": text[:300 + 40 * i]})
    for kind, rows in docs.items():
        with open(root / f"{kind}.jsonl", "w", encoding="utf-8") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows[:12])
    (root / "tiny_choice.yaml").write_text(_task_yaml(
        "tiny_choice", root / "choice.jsonl", "multiple_choice",
        ['doc_to_text: "{{context}}"', 'doc_to_choice: "{{choices}}"', 'doc_to_target: "{{label}}"',
         "metric_list: [{metric: acc}]"]))
    (root / "tiny_rolling.yaml").write_text(_task_yaml(
        "tiny_rolling", root / "rolling.jsonl", "loglikelihood_rolling",
        ['doc_to_text: ""', 'doc_to_target: "{{text}}"',
         "metric_list: [{metric: word_perplexity}, {metric: byte_perplexity}, "
         "{metric: bits_per_byte}]"]))
    (root / "tiny_until.yaml").write_text(_task_yaml(
        "tiny_until", root / "until.jsonl", "generate_until",
        ['doc_to_text: "{{prompt}}"', 'doc_to_target: "{{answer}}"',
         'generation_kwargs: {until: ["\\n", "):"], max_gen_toks: 10, do_sample: false}',
         "metric_list: [{metric: exact_match}]"]))


@pytest.fixture(scope="module")
def evaluated(tiny_corpus, tmp_path_factory):
    """A tiny run's checkpoint (TP1), its HF export, the three tasks, and lm_eval's `hf`
    backend's results on the export (with every sample's response)."""
    from pretrain_gpt2 import run as pretrain
    from tests.harness.corpus import stdlib_texts as _stdlib_texts
    tmp = tmp_path_factory.mktemp("lm_eval")
    pretrain(tiny_gpt_args(tiny_corpus, tmp, *TRAIN, "--save", str(tmp / "ck")))
    run_tool("convert_checkpoint", ["--input-format", "megatron", "--output-format", "hf",
                                    "--load", str(tmp / "ck"), "--save", str(tmp / "hf"),
                                    "--vocab-file", tiny_corpus["vocab"], "--merge-file",
                                    tiny_corpus["merges"]])
    tasks = tmp / "tasks"
    tasks.mkdir()
    _write_tasks(tasks, _stdlib_texts(12)[4:])
    reference = _evaluate("hf", f"pretrained={tmp / 'hf'},dtype=float32", tasks)
    return {"root": tmp, "tasks": tasks, "corpus": tiny_corpus, "hf": reference}


def _evaluate(model, model_args, tasks):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager
    from app.inference.lm_eval_backend import register
    register()  # megatron_gpt2 (importing the module registers it; again is a no-op)
    return simple_evaluate(model=model, model_args=model_args, tasks=TASKS, batch_size=4,
                           device="cpu", log_samples=True,
                           # only the tests' tasks: indexing lm_eval's own thousands of task
                           # files costs ~8 s of CPU per call (the CLI tests keep them)
                           task_manager=TaskManager(include_path=str(tasks),
                                                    include_defaults=False))


def _responses(samples):
    """{task: [(doc_id, filtered response), ...]} of lm_eval's per-sample log."""
    return {task: sorted((s["doc_id"], json.dumps(s["filtered_resps"])) for s in rows)
            for task, rows in samples.items()}


def _assert_same_scores(ours, reference):
    """Accuracy and exact match equal, perplexities within 1e-4, generations and choices equal."""
    for task in TASKS:
        got, want = ours["results"][task], reference["results"][task]
        for key, value in want.items():
            if not isinstance(value, float) or "stderr" in key:
                continue
            if key.startswith(("acc", "exact_match")):
                assert got[key] == value, (task, key, got[key], value)
            else:
                assert got[key] == pytest.approx(value, rel=1e-4), (task, key, got[key], value)
    ours_samples, want_samples = _responses(ours["samples"]), _responses(reference["samples"])
    assert ours_samples["tiny_until"] == want_samples["tiny_until"]
    for (doc, got), (_, want) in zip(ours_samples["tiny_choice"], want_samples["tiny_choice"]):
        got_lls = [float(ll) for ll, _ in json.loads(got)]  # the CLI's sample files hold strings
        want_lls = [float(ll) for ll, _ in json.loads(want)]
        assert got_lls == pytest.approx(want_lls, rel=1e-4, abs=1e-4), doc
        assert max(range(3), key=got_lls.__getitem__) == max(range(3), key=want_lls.__getitem__)


def _load_args(evaluated, *extra):
    c = evaluated["corpus"]
    return ",".join([f"load={evaluated['root'] / 'ck'}", f"vocab_file={c['vocab']}",
                     f"merge_file={c['merges']}", *extra])


def test_tp1_scores_equal_the_hf_backend_on_the_export(evaluated):
    reference = evaluated["hf"]
    assert reference["results"]["tiny_choice"]["acc,none"] > 0.0
    assert any(json.loads(r)[0] for _, r in _responses(reference["samples"])["tiny_until"]), \
        "the reference generated nothing: the generation task checks nothing"
    ours = _evaluate("megatron_gpt2", _load_args(evaluated), evaluated["tasks"])
    _assert_same_scores(ours, reference)


def _cli_results(out_dir):
    results = glob.glob(str(out_dir / "**" / "results_*.json"), recursive=True)
    assert len(results) == 1, results
    with open(results[0], encoding="utf-8") as f:
        ours = json.load(f)
    assert ours["config"]["model"] == "megatron_gpt2"
    ours["samples"] = {}
    for task in TASKS:
        (path,) = glob.glob(str(out_dir / "**" / f"samples_{task}_*.jsonl"), recursive=True)
        with open(path, encoding="utf-8") as f:
            ours["samples"][task] = [json.loads(line) for line in f if line.strip()]
    return ours


@pytest.mark.parametrize("launch", ["spawned", "torchrun"])
def test_tp2_scores_equal_the_hf_backend_on_the_export(evaluated, launch, tmp_path):
    """TP2 from the command line: the second rank spawned from --model_args, or both started by
    torchrun; only rank 0 writes results."""
    lm_eval_args = ["--model", "megatron_gpt2", "--model_args",
                    _load_args(evaluated, "tensor_model_parallel_size=2"),
                    "--tasks", ",".join(TASKS), "--include_path", str(evaluated["tasks"]),
                    "--batch_size", "3", "--log_samples", "--output_path", str(tmp_path / "out")]
    module = ["-m", "app.inference.lm_eval_backend", *lm_eval_args]
    if launch == "spawned":
        command = [sys.executable, *module]
    else:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   "--nproc-per-node=2", *module]
    run(command, tmp_path, timeout=300)
    _assert_same_scores(_cli_results(tmp_path / "out"), evaluated["hf"])


def test_deepspeed_checkpoint_scores_like_its_export(zero2_dp2_run, evaluated, tmp_path):
    """A DeepSpeed ZeRO-2 checkpoint is read through the converter's reader (fp32 masters) and
    scores what lm_eval's `hf` backend scores on its export."""
    c = evaluated["corpus"]
    run_tool("convert_checkpoint", ["--input-format", "deepspeed", "--output-format", "hf",
                                    "--load", str(zero2_dp2_run / "ck"), "--save",
                                    str(tmp_path / "hf"), "--vocab-file", c["vocab"],
                                    "--merge-file", c["merges"]])
    ours = _evaluate("megatron_gpt2", f"load={zero2_dp2_run / 'ck'},vocab_file={c['vocab']},"
                     f"merge_file={c['merges']}", evaluated["tasks"])
    _assert_same_scores(ours, _evaluate("hf", f"pretrained={tmp_path / 'hf'},dtype=float32",
                                        evaluated["tasks"]))


def test_bad_model_args_name_the_argument(evaluated):
    from app.inference.lm_eval_backend import MegatronGPT2LM
    with pytest.raises(ValueError, match="tokenizer_file"):
        MegatronGPT2LM(load=str(evaluated["root"] / "ck"), tokenizer_file="x")
    with pytest.raises(ValueError, match="no 'auto'"):
        MegatronGPT2LM(load=str(evaluated["root"] / "ck"), batch_size="auto")


def test_an_unreachable_dataset_says_what_to_do(tmp_path, monkeypatch, capsys):
    """A task whose dataset is on the Hub, with the Hub unreachable (offline mode): exit status 2
    and what to do (the cache, or a local task), not `datasets`' traceback. The model is the
    legacy fixture checkpoint (tests/data/old_checkpoints), which lm_eval builds first."""
    import datasets
    from app.inference.lm_eval_backend import main
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    (tmp_path / "hub_task.yaml").write_text(
        "task: hub_task\ndataset_path: gpt2-megatron-tests/not-on-this-machine\n"
        "test_split: test\noutput_type: loglikelihood_rolling\ndoc_to_text: \"\"\n"
        "doc_to_target: \"{{text}}\"\n")
    fixtures = os.path.join(ROOT, "tests", "data", "old_checkpoints")
    model_args = (f"load={os.path.join(fixtures, 'v0.2.0', 'native_fp32')},"
                  f"vocab_file={os.path.join(fixtures, 'data', 'vocab.json')},"
                  f"merge_file={os.path.join(fixtures, 'data', 'merges.txt')}")
    with pytest.raises(SystemExit) as stopped:
        main(["--model", "megatron_gpt2", "--model_args", model_args, "--tasks", "hub_task",
              "--include_path", str(tmp_path)])
    assert stopped.value.code == 2
    message = capsys.readouterr().err
    assert "Couldn't reach 'gpt2-megatron-tests/not-on-this-machine'" in message, message
    assert "HF_DATASETS_OFFLINE=1" in message and "--include_path DIR" in message
    assert "Offline evaluation" in message
