"""--tokenizer-type HuggingFaceTokenizer (Megatron's meaning): a tokenizer.json trained here
with `tokenizers` (no downloads); tools/preprocess_data.py writes, document by document, what
transformers' AutoTokenizer gives plus the eos as eod; bad input is one clear error before any
work; a tiny run (the Llama recipe with Mixture of Experts: Mixtral's block) trains on the data
without --vocab-file and its checkpoint generates text, serves, evaluates and exports."""
import contextlib
import io
import json

import numpy as np
import pytest

from app.data.tokenizer import build_tokenizer
from tests.harness.tokenizers import TEXTS, train_hf_tokenizer

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    return train_hf_tokenizer(tmp_path_factory.mktemp("hf_tok") / "tok")


def _preprocess(tmp_path, tokenizer_args):
    from tools.preprocess_data import main
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    prefix = str(tmp_path / "docs")
    main(["--input", str(data), "--output-prefix", prefix, "--append-eod",
          "--workers", "1", *tokenizer_args])
    return prefix + "_text_document"


def test_preprocessing_equals_auto_tokenizer_plus_eod(tmp_path, tokenizer_dir):
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    prefix = _preprocess(tmp_path, ["--tokenizer-type", "HuggingFaceTokenizer",
                                    "--tokenizer-model", tokenizer_dir])
    reference = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    ours = build_tokenizer("HuggingFaceTokenizer", None, None, tokenizer_model=tokenizer_dir)
    assert ours.eod == reference.eos_token_id and ours.vocab_size == len(reference)
    dataset = IndexedDataset(prefix)  # Megatron Core's reader
    assert len(dataset) == len(TEXTS)  # an empty text is still [bos] + eod
    for i, text in enumerate(TEXTS):
        want = reference(text).input_ids + [reference.eos_token_id]
        assert want[0] == reference.bos_token_id
        np.testing.assert_array_equal(dataset[i], np.asarray(want), err_msg=text)


def test_bad_tokenizer_model_is_one_clear_error(tmp_path, capsys):
    from tools.preprocess_data import main
    data = tmp_path / "docs.jsonl"
    data.write_text(json.dumps({"text": "hello"}) + "\n")
    for args, words in (([], "needs --tokenizer-model"),
                        (["--tokenizer-model", str(tmp_path / "missing")], "missing"),
                        (["--tokenizer-model", train_hf_tokenizer(tmp_path / "no_eos", eos=None)],
                         "no eos token")):
        with pytest.raises(SystemExit) as stop:  # a missing path: a usage error, on stderr
            main(["--input", str(data), "--output-prefix",
                  str(tmp_path / "out"), "--tokenizer-type", "HuggingFaceTokenizer", *args])
        assert words in f"{stop.value.code} {capsys.readouterr().err}", words
    assert not list(tmp_path.glob("out*"))


def test_a_tiny_run_trains_on_it_without_a_vocab_file(tmp_path, tokenizer_dir):
    from pretrain_gpt2 import main
    prefix = _preprocess(tmp_path, ["--tokenizer-type", "HuggingFaceTokenizer",
                                    "--tokenizer-model", tokenizer_dir])
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4",
                     "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "2",
                     "--train-iters", "2", "--lr", "1e-3", "--eval-iters", "0",
                     "--data-path", prefix, "--split", "100,0,0",
                     "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
                     tokenizer_dir, "--swiglu", "--normalization", "RMSNorm",
                     "--disable-bias-linear", "--position-embedding-type", "rope",
                     "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size",
                     "16",
                     "--data-cache-path", str(tmp_path / "cache"), "--num-workers", "0",
                     "--distributed-backend", "gloo", "--save", str(tmp_path / "ckpt"),
                     "--save-interval", "2"])
    assert code == 0, err.getvalue()[-2000:]
    import torch
    args = torch.load(next((tmp_path / "ckpt").rglob("model_optim_rng.pt")),
                      weights_only=False)["args"]
    assert args.tokenizer_type == "HuggingFaceTokenizer"
    assert args.tokenizer_model == tokenizer_dir
    assert (args.swiglu, args.normalization, args.add_bias_linear) == (True, "RMSNorm", False)
    assert (args.num_experts, args.moe_router_topk, args.moe_ffn_hidden_size) == (4, 2, 16)
    from app.inference.session import GenerationParams, InferenceSession
    session = InferenceSession(str(tmp_path / "ckpt"))  # the tokenizer comes from the args
    assert session.tokenizer.eod == transformers.AutoTokenizer.from_pretrained(
        tokenizer_dir).eos_token_id
    out = session.generate(["hello world"], GenerationParams(max_new_tokens=3))
    (result,) = out["results"]
    assert result["prompt"] == "hello world" and 1 <= len(result["generated_tokens"]) <= 3
    _moe_checkpoint_serves_everywhere(tmp_path, session, tokenizer_dir)


def _moe_checkpoint_serves_everywhere(tmp_path, session, tokenizer_dir):
    """The Llama-recipe MoE checkpoint of the run above (HuggingFaceTokenizer named in its
    args): the HF export carries that tokenizer and gives our logits as MixtralForCausalLM; the
    server, tools/generate.py, tools/evaluate.py (on the export, read back) and the lm-eval
    backend load and run it."""
    import torch
    from app.inference.generation import generate
    from app.inference.sampling import SamplingConfig
    from app.inference.server import create_app
    from tests.harness.tools import load_tool
    ckpt, hf = str(tmp_path / "ckpt"), str(tmp_path / "hf")
    assert load_tool("convert_checkpoint").main(["--load", ckpt, "--save", hf,
                                                 "--output-format", "hf"]) == 0
    model = transformers.MixtralForCausalLM.from_pretrained(hf).eval().requires_grad_(False)
    exported = transformers.AutoTokenizer.from_pretrained(hf)
    reference = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    assert exported("the lazy dog").input_ids == reference("the lazy dog").input_ids
    ids = torch.tensor([exported("the quick brown fox jumps").input_ids[:16]])
    positions = torch.arange(ids.shape[1]).unsqueeze(0)
    ours = session.runner.forward(ids, positions)[..., :session.vocab_size]
    torch.testing.assert_close(model(ids).logits, ours, rtol=1e-4, atol=1e-4)
    prompt = session.tokenizer.tokenize("hello world")
    greedy = generate(session.runner, [prompt], 4, SamplingConfig(greedy=True),
                      session.tokenizer.eod, session.vocab_size, session.max_positions).tokens
    client = create_app(session, max_batch=2).test_client()
    reply = client.put("/api", json={"prompts": ["hello world"], "tokens_to_generate": 4})
    assert reply.status_code == 200 and reply.get_json()["generated_tokens"] == greedy
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert load_tool("generate").main(["--load", ckpt, "--prompt", "hello world",
                                           "--max-new-tokens", "4", "--greedy",
                                           "--output", "jsonl"]) == 0
    (row,) = [json.loads(line) for line in out.getvalue().splitlines() if line.startswith("{")]
    assert row["generated_tokens"] == greedy[0]
    text = tmp_path / "valid.txt"
    text.write_text(" ".join(TEXTS[:8]))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert load_tool("evaluate").main(["--load", hf, "--task", "wikitext",
                                           "--valid-data", str(text)]) == 0
    assert json.loads(out.getvalue().splitlines()[-1])["loss"] > 0
    _hf_directory_without_tokenizer(tmp_path, hf, tokenizer_dir, greedy[0])
    pytest.importorskip("lm_eval")
    from lm_eval.api.instance import Instance
    from app.inference.lm_eval_backend import MegatronGPT2LM
    lm = MegatronGPT2LM(load=ckpt)
    try:
        (logprob, _), = lm.loglikelihood([Instance(
            "loglikelihood", {}, ("the quick brown", " fox"), 0)])
        context, continuation = (reference(t, add_special_tokens=False).input_ids
                                 for t in ("the quick brown", " fox"))  # as lm-eval's hf
        full = torch.tensor([context + continuation])
        logits = model(full).logits[0, len(context) - 1:-1].log_softmax(-1)
        want = logits.gather(-1, torch.tensor(continuation)[:, None]).sum()
        assert logprob == pytest.approx(float(want), abs=1e-3)
    finally:
        lm.close()


def _hf_directory_without_tokenizer(tmp_path, hf, tokenizer_dir, greedy):
    """A Hugging Face directory that carries no tokenizer files: tools/generate.py says
    which flag to pass, and with --tokenizer-model generates what the exported tokenizer did."""
    import shutil
    from tests.harness.tools import load_tool
    bare = tmp_path / "hf_bare"
    shutil.copytree(hf, bare, ignore=shutil.ignore_patterns("tokenizer*", "special_tokens*"))
    argv = ["--load", str(bare), "--prompt", "hello world", "--max-new-tokens", "4",
            "--greedy", "--output", "jsonl"]
    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        try:
            code = load_tool("generate").main(argv)
        except SystemExit as exc:
            code = exc.code
    assert code not in (0, None) and "--tokenizer-model" in err.getvalue() + out.getvalue()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert load_tool("generate").main(argv + ["--tokenizer-model", tokenizer_dir]) == 0
    (row,) = [json.loads(line) for line in out.getvalue().splitlines() if line.startswith("{")]
    assert row["generated_tokens"] == greedy


@pytest.fixture(scope="module")
def sentencepiece_model(tmp_path_factory):
    spm = pytest.importorskip("sentencepiece")
    path = tmp_path_factory.mktemp("spm") / "tok.model"
    with open(path, "wb") as f:
        spm.SentencePieceTrainer.train(sentence_iterator=iter(TEXTS * 4), model_writer=f,
                                       vocab_size=60, model_type="bpe", pad_id=3,
                                       minloglevel=2)
    return str(path)


def test_sentencepiece_tokenizers_follow_megatron(tmp_path, sentencepiece_model):
    """GPTSentencePieceTokenizer is the .model as it is (eod = its eos, here id 2); the
    SentencePieceTokenizer appends Megatron's <CLS> <SEP> <EOD> <MASK> after the pieces (the
    model's pad/bos/eos pieces exist already) and splits text at them."""
    import sentencepiece
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    sp = sentencepiece.SentencePieceProcessor(model_file=sentencepiece_model)
    gpt = build_tokenizer("GPTSentencePieceTokenizer", None, None,
                          tokenizer_model=sentencepiece_model)
    assert (gpt.vocab_size, gpt.eod) == (60, 2)
    full = build_tokenizer("SentencePieceTokenizer", None, None,
                           tokenizer_model=sentencepiece_model)
    assert (full.vocab_size, full.eod) == (64, 62)  # <CLS> 60, <SEP> 61, <EOD> 62, <MASK> 63
    assert full.tokenize("the fox<EOD>the dog<MASK>") == (
        sp.encode_as_ids("the fox") + [62] + sp.encode_as_ids("the dog") + [63])
    prefix = _preprocess(tmp_path, ["--tokenizer-type", "GPTSentencePieceTokenizer",
                                    "--tokenizer-model", sentencepiece_model])
    dataset = IndexedDataset(prefix)
    texts = [t for t in TEXTS if t]  # no tokens (no BOS here): an empty document is skipped
    assert len(dataset) == len(texts)
    for i, text in enumerate(texts):
        np.testing.assert_array_equal(dataset[i], np.asarray(sp.encode_as_ids(text) + [2]))
    with pytest.raises(FileNotFoundError, match="needs --tokenizer-model"):
        build_tokenizer("GPTSentencePieceTokenizer", None, None, tokenizer_model=None)
