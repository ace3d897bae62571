"""The tools' command lines, generated from their option dataclasses (app/config/cli.py).

- Every flag recorded from the hand-written parsers the generated ones replaced
  (tests/data/recorded_tool_flags.json) is still accepted by its tool, spelling by spelling, with
  the same dest, default, help, choices, nargs, type, action and required-ness.
- Command lines parse to the values the old parsers gave, and the checks that were parser
  errors are still usage errors (exit status 2, the flag named).
- A flag that names an input path (a checkpoint, a tokenizer, a corpus, a metrics file) which
  does not exist is the same usage error in every tool: exit status 2, one line naming the flag,
  the path and what to pass, before any work.
- No option is declared twice: the inference tools and the lm-eval backend take the checkpoint
  from the one InferenceLoadConfig, and no two tool fields declare the same flag identically.
"""
import argparse
import importlib
import json
import os
import pathlib
import sysconfig
from typing import Dict

import pytest

from app.config.cli import collect_options, tool_parser
from app.config.inference import InferenceLoadConfig

RECORDED = pathlib.Path(__file__).resolve().parents[1] / "data" / "recorded_tool_flags.json"
OPTIONS = {"generate": "GenerateOptions", "evaluate": "EvaluateOptions",
           "run_text_generation_server": "ServerOptions", "preprocess_data": "PreprocessOptions",
           "train_tokenizer": "TrainTokenizerOptions", "measure_peak_flops": "PeakFlopsOptions",
           "build_stdlib_corpus": "StdlibCorpusOptions", "gpu_report": "GpuReportOptions",
           "build_kernels": "BuildKernelsOptions", "plot_metrics": "PlotOptions",
           "convert_checkpoint": "ConvertOptions"}
"""Each tool (tools/NAME.py) and the class its command line is parsed into."""
KINDS = {"_StoreAction": argparse._StoreAction, "_StoreTrueAction": argparse._StoreTrueAction,
         "_ExtendAction": argparse._ExtendAction}


def _options_class(tool: str) -> type:
    return getattr(importlib.import_module(f"tools.{tool}"), OPTIONS[tool])


def _machine_default(tool: str, flag: str):
    """The defaults the old parsers computed on the machine (recorded as '<machine-dependent>')."""
    if (tool, flag) == ("measure_peak_flops", "--device"):
        import torch
        return "cuda" if torch.cuda.is_available() else "cpu"
    if (tool, flag) == ("build_stdlib_corpus", "--stdlib-dir"):
        return sysconfig.get_paths()["stdlib"]
    raise AssertionError(f"no machine default known for {tool} {flag}")


def _recorded():
    return [(tool, flag) for tool, flags in json.loads(RECORDED.read_text())["tools"].items()
            for flag in flags]


@pytest.fixture(scope="module")
def parsers() -> Dict[str, dict]:
    """{tool: {spelling: argparse action}} of each tool's generated parser."""
    return {tool: {s: a for a in tool_parser(_options_class(tool), "")._actions
                   for s in a.option_strings} for tool in OPTIONS}


@pytest.mark.parametrize("tool,old", _recorded(), ids=lambda x: x if isinstance(x, str)
                         else x["flags"][0])
def test_recorded_tool_flag_keeps_its_meaning(parsers, tool, old):
    for spelling in old["flags"]:
        assert spelling in parsers[tool], f"tools/{tool}.py no longer accepts {spelling}"
        action = parsers[tool][spelling]
        assert action.dest == old["dest"]
        default = old["default"]
        if default == "<machine-dependent>":
            default = _machine_default(tool, old["flags"][0])
        assert action.default == default
        if old["help"] is not None:
            assert action.help == old["help"]
        # every value accepted then is accepted now (a new choice may be added)
        assert (action.choices is None) == (old["choices"] is None)
        assert set(old["choices"] or []) <= set(action.choices or [])
        assert action.nargs == old["nargs"]
        assert action.required == old["required"]
        assert type(action) is KINDS[old["kind"]]
        if old["type"] is not None:  # None and str both leave the string as it is
            assert getattr(action.type, "__name__", None) == old["type"]


@pytest.fixture
def named_paths(tmp_path, monkeypatch):
    """A working directory holding the paths the command lines below name: ck/ (a directory),
    v.json, m.txt, d.jsonl, d and f (files)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ck").mkdir()
    for name in ("v.json", "m.txt", "d.jsonl", "d", "f"):
        (tmp_path / name).write_text("{}\n")
    return tmp_path


def _parse(tool: str, argv):
    from app.config.cli import parse_config
    return parse_config(_options_class(tool), argv, tool)


def test_generate_command_line_parses_to_the_old_values(named_paths):
    a = _parse("generate", ["--load", "ck", "--vocab-file", "v.json", "--max-new-tokens", "4",
                            "--prompt", "a", "b", "--prompt", "c", "--top-k", "5", "--top-p",
                            "0.5", "--temperature", "0.7", "--seed", "3", "--output", "jsonl",
                            "--no-kv-cache", "--tensor-model-parallel-size", "2"])
    assert a.checkpoint == InferenceLoadConfig(load="ck", vocab_file="v.json",
                                               tensor_model_parallel_size=2)
    assert (a.prompt, a.prompts_file, a.max_new_tokens, a.top_k, a.top_p, a.temperature, a.seed,
            a.output, a.no_kv_cache, a.greedy, a.num_beams) == \
        (["a", "b", "c"], None, 4, 5, 0.5, 0.7, 3, "jsonl", True, False, 1)
    b = _parse("generate", ["--load", "ck", "--max-new-tokens", "1", "--prompts-file", "-"])
    assert (b.prompt, b.prompts_file, b.top_p_decay, b.length_penalty) == (None, "-", 0.0, 1.0)
    for hub_name in ("gpt2", "org/name"):  # may be in the Hub cache: not a path to check
        c = _parse("generate", ["--load", "ck", "--max-new-tokens", "1", "--tokenizer-model",
                                hub_name])
        assert c.checkpoint.tokenizer_model == hub_name


def test_evaluate_and_server_command_lines_parse_to_the_old_values(named_paths):
    e = _parse("evaluate", ["--load", "ck", "--task", "lambada", "--valid-data", "d.jsonl",
                            "--strict-lambada", "--micro-batch-size", "2", "--json-key", "t"])
    assert (e.task, e.valid_data, e.strict_lambada, e.micro_batch_size, e.json_key,
            e.seq_length, e.overlapping_eval, e.no_detokenize, e.results_file) == \
        ("lambada", "d.jsonl", True, 2, "t", None, None, False, None)
    s = _parse("run_text_generation_server", ["--load", "ck", "--port", "0", "--host", "::1"])
    assert (s.host, s.port, s.max_batch_size, s.max_request_bytes) == ("::1", 0, 64, 1 << 20)
    p = _parse("preprocess_data", ["--input", "d.jsonl", "--output-prefix", "o", "--vocab",
                                   "v.json", "--json-keys", "a", "b", "--append-eod"])
    assert (p.vocab_file, p.json_keys, p.append_eod, p.workers, p.tokenizer_type) == \
        ("v.json", ["a", "b"], True, 1, "GPT2BPETokenizer")


@pytest.mark.parametrize("tool,argv,message", [
    ("generate", ["--max-new-tokens", "1"], "the following arguments are required: --load"),
    ("generate", ["--load", "ck", "--max-new-tokens", "1", "--prompt", "a", "--prompts-file",
                  "f"], "--prompt and --prompts-file f were both given"),
    ("evaluate", ["--load", "ck", "--task", "squad", "--valid-data", "d"],
     "--task: invalid choice"),
    ("run_text_generation_server", ["--load", "ck", "--max-request-bytes", "0"],
     "--max-request-bytes must be >= 1, got 0"),
    ("preprocess_data", ["--input", "no-such.jsonl", "--output-prefix", "o"],
     "--input no-such.jsonl does not exist: pass the corpus file"),
    ("train_tokenizer", ["--input", "no-such.txt", "--output-dir", "o"],
     "--input no-such.txt does not exist: pass text or JSONL files"),
    ("measure_peak_flops", ["--dtype", "fp8"], "--dtype: unknown dtype 'fp8'"),
    ("build_stdlib_corpus", ["--output", "o", "--stdlib-dir", "no-such-dir"],
     "--stdlib-dir no-such-dir does not exist: pass a Python standard library directory"),
    ("build_stdlib_corpus", ["--output", "o", "--stdlib-dir", "f"],
     "--stdlib-dir f is not a directory: pass"),
    ("gpu_report", ["--out", "o", "--mode", "tpu"], "--mode: invalid choice"),
    ("convert_checkpoint", ["--load", "ck", "--iteration", "last"],
     "--iteration 'last': expected a number or 'release'"),
    ("convert_checkpoint", ["--load", "ck", "--iteration", "-1"], "--iteration must be >= 0, got -1"),
    ("convert_checkpoint", ["--load", "ck", "--output-format", "deepspeed"],
     "--output-format: invalid choice"),
    ("convert_checkpoint", ["--load", "ck", "--save", "o", "--target-pipeline-model-parallel-size",
                            "0"], "--target-pipeline-model-parallel-size must be >= 1, got 0"),
    ("convert_checkpoint", ["--load", "ck"],
     "--save DIR is required (unless --print-checkpoint-structure)"),
])
def test_bad_command_lines_are_usage_errors(tool, argv, message, capsys, named_paths):
    with pytest.raises(SystemExit) as stopped:
        _parse(tool, argv)
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert message in err and err.startswith("usage:"), err


def test_the_inference_tools_share_one_checkpoint_declaration(named_paths):
    """generate, evaluate and the server read --load ... into the same InferenceLoadConfig; the
    lm-eval backend reads its --model_args keys (the flags' dests) into it too."""
    argv = ["--load", "ck", "--merge-file", "m.txt", "--pipeline-model-parallel-size", "2"]
    extra = {"generate": ["--max-new-tokens", "1"], "run_text_generation_server": [],
             "evaluate": ["--task", "wikitext", "--valid-data", "d"]}
    want = InferenceLoadConfig(load="ck", merge_file="m.txt", pipeline_model_parallel_size=2)
    for tool, own in extra.items():
        assert _parse(tool, argv + own).checkpoint == want, tool
    pytest.importorskip("lm_eval")
    from app.inference.lm_eval_backend import checkpoint_of
    assert checkpoint_of({"load": "ck", "merge_file": "m.txt",
                          "pipeline_model_parallel_size": 2}) == want
    with pytest.raises(ValueError, match="vocab_file, merge_file"):
        checkpoint_of({"load": "ck", "vocab": "v.json"})


def test_no_flag_is_declared_twice():
    """Within a tool a spelling or dest belongs to one field (collect_options refuses two); across
    the tools, two fields may share a spelling only when they mean different things (an identical
    declaration in two tools must be one shared field, as InferenceLoadConfig is)."""
    seen = {}
    for tool in OPTIONS:
        for opt in collect_options([_options_class(tool)]):
            f = opt.flag
            meaning = (f.spellings, f.dest, repr(opt.value_type), repr(opt.default), f.nargs,
                       f.choices, f.required, f.help)
            declared = seen.setdefault(meaning, set())
            declared.add(f"{opt.owner.__module__}.{opt.owner.__qualname__}.{opt.path[-1]}")
    twice = {m[0]: sorted(d) for m, d in seen.items() if len(d) > 1}
    assert not twice, f"declared identically in several places: {twice}"
    shared = [o for o in collect_options([_options_class("evaluate")])
              if o.owner is InferenceLoadConfig]
    assert [o.flag.name for o in shared] == ["--load", "--vocab-file", "--merge-file",
                                             "--tokenizer-model",
                                             "--tensor-model-parallel-size",
                                             "--pipeline-model-parallel-size"]


MISSING_PATHS = {
    "convert_checkpoint": ({"--load": "dir", "--save": "out"},
                           ["--load", "--vocab-file", "--merge-file", "--tokenizer-model",
                            "--metrics-file"]),
    "generate": ({"--load": "dir", "--max-new-tokens": "1"},
                 ["--load", "--vocab-file", "--merge-file", "--tokenizer-model", "--prompts-file"]),
    "evaluate": ({"--load": "dir", "--task": "wikitext", "--valid-data": "file"},
                 ["--load", "--valid-data"]),
    "preprocess_data": ({"--input": "file", "--output-prefix": "out"},
                        ["--input", "--vocab-file", "--merge-file", "--tokenizer-model",
                         "--punkt-model"]),
    "train_tokenizer": ({"--input": "file", "--output-dir": "out"}, ["--input"]),
    "plot_metrics": ({"--output": "out"}, ["--metrics-file", "--tensorboard-dir"]),
    "build_stdlib_corpus": ({"--output": "out"}, ["--stdlib-dir"]),
}
"""Each tool: a command line whose paths exist, and the path-taking flags to give a missing
path ("dir" / "file": an existing one, "out": what the tool would write)."""


@pytest.mark.parametrize("tool,flag", [(t, f) for t, (_, flags) in MISSING_PATHS.items()
                                       for f in flags])
def test_a_missing_input_path_is_one_usage_error_naming_the_flag(tool, flag, tmp_path, capsys):
    """Through the tool's own main(argv): exit status 2, one error line with the flag, the path
    and what to pass; no traceback and nothing written."""
    (tmp_path / "dir").mkdir()
    (tmp_path / "file").write_text("{}\n")
    missing = str(tmp_path / "gone" / "tok.model")  # looks local even for --tokenizer-model
    base, _ = MISSING_PATHS[tool]
    named = {"dir": tmp_path / "dir", "file": tmp_path / "file", "out": tmp_path / "out",
             None: missing}
    argv = [str(a) for k, v in {**base, flag: None}.items() for a in (k, named.get(v, v))]
    try:
        code = importlib.import_module(f"tools.{tool}").main(argv)
    except SystemExit as stop:
        code = stop.code
    assert code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and f"{flag} {missing} does not exist: pass " in errors[0], errors
    assert sorted(os.listdir(tmp_path)) == ["dir", "file"]
