"""tools/preprocess_data.py, tools/build_stdlib_corpus.py end to end on a small stdlib corpus."""
import gzip
import json
import os
import struct
import subprocess
import sys

import numpy as np
import pytest

from app.data.tokenizer import train_gpt2_bpe
from tools import build_stdlib_corpus, preprocess_data


def read_pair(prefix):
    """Independent reader from the published format: (sequences, document index)."""
    with open(prefix + ".idx", "rb") as f:
        assert f.read(9) == b"MMIDIDX\x00\x00"
        version, code, n, d = struct.unpack("<QBQQ", f.read(25))
        assert version == 1 and code == 8  # uint16 for a small vocabulary
        lengths = struct.unpack(f"<{n}i", f.read(4 * n))
        pointers = struct.unpack(f"<{n}q", f.read(8 * n))
        doc_index = struct.unpack(f"<{d}q", f.read(8 * d))
    blob = open(prefix + ".bin", "rb").read()
    return [list(struct.unpack(f"<{ln}H", blob[p:p + 2 * ln])) for ln, p in zip(lengths, pointers)
            ], list(doc_index)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    path = str(root / "stdlib.jsonl")
    counts = build_stdlib_corpus.main(["--output", path, "--max-bytes", "400000"])
    assert 0 < counts["bytes"] <= 400000
    with open(path, encoding="utf-8") as f:
        docs = [json.loads(line) for line in f]
    docs.insert(3, {"content": "", "path": "empty.py"})  # an empty document
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(d) + "\n" for d in docs)
    vocab, merges = train_gpt2_bpe((d["content"] for d in docs), 1000, str(root / "tok"))
    return {"path": path, "docs": docs, "vocab": vocab, "merges": merges, "root": root}


def run(corpus, prefix, *extra, input_path=None):
    return preprocess_data.main([
        "--input", input_path or corpus["path"], "--output-prefix", str(prefix),
        "--json-keys", "content", "--vocab-file", corpus["vocab"], "--merge-file", corpus["merges"],
        "--append-eod", "--chunk-size", "2", "--log-interval", "4", *extra])


def test_output_matches_reference_tokenizer_and_is_identical_for_1_and_2_workers(
        corpus, tmp_path, capsys):
    from transformers import GPT2TokenizerFast

    counts = run(corpus, tmp_path / "w1", "--workers", "1")
    run(corpus, tmp_path / "w2", "--workers", "2")
    for ext in (".bin", ".idx"):
        one = open(str(tmp_path / "w1_content_document") + ext, "rb").read()
        two = open(str(tmp_path / "w2_content_document") + ext, "rb").read()
        assert one == two
    assert counts["empty_content"] == 1 and counts["documents"] == len(corpus["docs"])
    ref = GPT2TokenizerFast(vocab=corpus["vocab"], merges=corpus["merges"])
    eod = ref.convert_tokens_to_ids("<|endoftext|>")
    expected = [ref.encode(d["content"]) + [eod] for d in corpus["docs"] if d["content"]]
    seqs, doc_index = read_pair(str(tmp_path / "w1_content_document"))
    assert seqs == expected
    assert doc_index == list(range(len(expected) + 1))
    err = capsys.readouterr().err
    assert "docs/s" in err and "MB/s" in err and "tokens/s" in err and "ETA" in err


def test_gzip_input_gives_the_same_output(corpus, tmp_path):
    gz = str(tmp_path / "in.jsonl.gz")
    with open(corpus["path"], "rb") as src, gzip.open(gz, "wb") as dst:
        dst.write(src.read())
    run(corpus, tmp_path / "plain")
    run(corpus, tmp_path / "gz", input_path=gz)
    assert (open(str(tmp_path / "plain_content_document.bin"), "rb").read()
            == open(str(tmp_path / "gz_content_document.bin"), "rb").read())


def _write_lines(path, lines):
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    return str(path)


BAD_LINES = [json.dumps({"content": "a = 1"}), json.dumps({"content": "b = 2"}),
             '{"content": "broken', json.dumps({"path": "x.py"}), json.dumps({"content": "c = 3"})]


@pytest.mark.parametrize("lines,pattern,workers", [
    (BAD_LINES[:3], r"line 3: malformed JSON", "1"),
    (BAD_LINES[:3] + BAD_LINES[:2] * 10, r"line 3: malformed JSON", "2"),
    (BAD_LINES[:2] + BAD_LINES[3:], r"line 3: missing key 'content'.*--json-keys", "1"),
])
def test_bad_lines_stop_with_file_and_line(corpus, tmp_path, lines, pattern, workers):
    path = _write_lines(tmp_path / "bad.jsonl", lines)
    with pytest.raises(SystemExit, match=pattern) as info:
        run(corpus, tmp_path / "out", "--workers", workers, input_path=path)
    assert path in str(info.value.code)
    assert sorted(os.listdir(tmp_path)) == ["bad.jsonl"]  # nothing half-written left behind


def test_skip_bad_lines_counts_them(corpus, tmp_path):
    path = _write_lines(tmp_path / "bad.jsonl", BAD_LINES)
    counts = run(corpus, tmp_path / "out", "--skip-bad-lines", input_path=path)
    assert counts["bad_lines"] == 2 and counts["documents"] == 3
    seqs, _ = read_pair(str(tmp_path / "out_content_document"))
    assert len(seqs) == 3


def test_rejects_other_dataset_impl(corpus, tmp_path, capsys):
    with pytest.raises(SystemExit):
        run(corpus, tmp_path / "out", "--dataset-impl", "lazy")
    assert "only 'mmap'" in capsys.readouterr().err


def test_split_sentences_keep_newlines(corpus, tmp_path):
    from app.data import build_tokenizer

    text = ("The first sentence is here. The second one follows it.\n\nA new paragraph starts. "
            "It ends now.\n")
    docs = [json.dumps({"content": text})] * 2 + [json.dumps({"content": "Only one sentence."})]
    path = _write_lines(tmp_path / "s.jsonl", docs)
    run(corpus, tmp_path / "keep", "--split-sentences", "--keep-newlines", input_path=path)
    run(corpus, tmp_path / "strip", "--split-sentences", input_path=path)
    tok = build_tokenizer("GPT2BPETokenizer", corpus["vocab"], corpus["merges"])
    seqs, doc_index = read_pair(str(tmp_path / "keep_content_sentence"))
    assert doc_index == [0, 4, 8, 9]
    first_doc = "".join(tok.detokenize(s) for s in seqs[:4])
    assert first_doc == text + "<|endoftext|>"  # nothing lost, EOD after the last sentence
    stripped, _ = read_pair(str(tmp_path / "strip_content_sentence"))
    assert tok.detokenize(stripped[1]) == "The second one follows it."


def test_build_stdlib_corpus_is_sorted_bounded_and_skips_non_utf8(tmp_path):
    root = tmp_path / "lib"
    (root / "pkg").mkdir(parents=True)
    (root / "site-packages").mkdir()
    (root / "b.py").write_text("b = 1\n")
    (root / "a.py").write_text("a = 1\n")
    (root / "pkg" / "c.py").write_text("c = 'é'\n")
    (root / "latin.py").write_bytes("x = 'é'\n".encode("latin-1"))
    (root / "site-packages" / "s.py").write_text("s = 1\n")
    (root / "notes.txt").write_text("not python")
    out = str(tmp_path / "c.jsonl")
    counts = build_stdlib_corpus.main(["--output", out, "--stdlib-dir", str(root)])
    lines = [json.loads(line) for line in open(out, encoding="utf-8")]
    assert [d["path"] for d in lines] == ["a.py", "b.py", "pkg/c.py"]
    assert lines[2]["content"] == "c = 'é'\n"
    assert counts == {"files": 3, "bytes": 6 + 6 + len("c = 'é'\n".encode()), "skipped_non_utf8": 1}
    counts = build_stdlib_corpus.main(["--output", out, "--stdlib-dir", str(root), "--max-bytes", "12"])
    assert counts["files"] == 2 and len(open(out).readlines()) == 2


def test_punkt_model_saved_and_loaded(corpus, tmp_path):
    from app.data import build_tokenizer
    from app.data.sentences import load_punkt_params

    text = "Dr. Smith met Mr. Jones at noon yesterday. They talked. Prof. Lee came later. " * 40
    path = _write_lines(tmp_path / "s.jsonl", [json.dumps({"content": text})])
    model = str(tmp_path / "punkt")
    run(corpus, tmp_path / "trained", "--split-sentences", "--save-punkt-model", model,
        input_path=path)
    params = load_punkt_params(model)
    assert {"dr", "mr", "prof"} <= params.abbrev_types
    run(corpus, tmp_path / "loaded", "--split-sentences", "--punkt-model", model, input_path=path)
    for ext in (".bin", ".idx"):
        assert (open(str(tmp_path / "trained_content_sentence") + ext, "rb").read()
                == open(str(tmp_path / "loaded_content_sentence") + ext, "rb").read())
    # the loaded model splits a new text at its sentence ends, not after the abbreviations
    small = "Dr. Brown saw Mr. Green at the station. It rained. Prof. White stayed home."
    small_path = _write_lines(tmp_path / "small.jsonl", [json.dumps({"content": small})])
    run(corpus, tmp_path / "small", "--split-sentences", "--punkt-model", model,
        input_path=small_path)
    seqs, doc_index = read_pair(str(tmp_path / "small_content_sentence"))
    tok = build_tokenizer("GPT2BPETokenizer", corpus["vocab"], corpus["merges"])
    assert [tok.detokenize(s) for s in seqs] == [
        "Dr. Brown saw Mr. Green at the station.", "It rained.",
        "Prof. White stayed home.<|endoftext|>"]
    assert doc_index == [0, 3]
    os.remove(os.path.join(model, "abbrev_types.txt"))
    with pytest.raises(FileNotFoundError, match="abbrev_types.txt"):
        run(corpus, tmp_path / "x", "--split-sentences", "--punkt-model", model, input_path=path)


def test_several_json_keys_give_one_pair_each(corpus, tmp_path):
    from app.data import MMapIndexedDataset, build_tokenizer

    lines = [json.dumps({"content": f"x = {i}", "path": f"m{i}.py"}) for i in range(5)]
    path = _write_lines(tmp_path / "k.jsonl", lines)
    preprocess_data.main(["--input", path, "--output-prefix", str(tmp_path / "o"), "--json-keys",
                          "content", "path", "--vocab-file", corpus["vocab"], "--merge-file",
                          corpus["merges"]])
    tok = build_tokenizer("GPT2BPETokenizer", corpus["vocab"], corpus["merges"])
    for key, template in (("content", "x = {}"), ("path", "m{}.py")):
        ds = MMapIndexedDataset(str(tmp_path / f"o_{key}_document"))
        assert [tok.detokenize(ds[i]) for i in range(len(ds))] == [template.format(i)
                                                                   for i in range(5)]


def test_preprocess_does_not_import_torch():
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    code = "import sys, tools.preprocess_data; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=root)
    assert out.stdout.strip() == "False"  # workers start fast; torch is only for batches


def test_temporaries_left_by_a_killed_run_are_removed(corpus, tmp_path, capsys):
    """A killed preprocess leaves `<output>.bin.tmp.<pid>`; the next run for that prefix removes
    it (its writer is dead), and leaves other prefixes' files and live writers' files alone."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    writer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    stale = tmp_path / f"out_content_document.bin.tmp.{dead.pid}"
    live = tmp_path / f"out_content_document.bin.tmp.{writer.pid}"
    other = tmp_path / f"another_content_document.bin.tmp.{dead.pid}"
    for path in (stale, live, other):
        path.write_bytes(b"\0" * 4096)
    try:
        run(corpus, tmp_path / "out")
    finally:
        writer.kill()
        writer.wait()
    assert not stale.exists() and live.exists() and other.exists()
    assert f"removed {stale}" in capsys.readouterr().err


def test_empty_input_is_an_error_and_writes_nothing(corpus, tmp_path):
    for name, lines in (("empty.jsonl", []), ("blank.jsonl", ["", "  "]),
                        ("no_text.jsonl", [json.dumps({"content": ""})] * 3)):
        path = _write_lines(tmp_path / name, lines)
        with pytest.raises(SystemExit) as info:
            run(corpus, tmp_path / "out", input_path=path)
        assert path in str(info.value.code) and "nothing was written" in str(info.value.code)
    assert not [n for n in os.listdir(tmp_path) if n.startswith("out")]


def test_truncated_gzip_names_the_file(corpus, tmp_path):
    whole = tmp_path / "whole.jsonl.gz"
    with gzip.open(whole, "wb") as f:
        f.write(open(corpus["path"], "rb").read())
    cut = tmp_path / "cut.jsonl.gz"
    cut.write_bytes(whole.read_bytes()[: whole.stat().st_size // 2])
    with pytest.raises(SystemExit, match=r"cut\.jsonl\.gz is truncated or corrupt.*EOFError"):
        run(corpus, tmp_path / "out", input_path=str(cut))
    assert sorted(os.listdir(tmp_path)) == ["cut.jsonl.gz", "whole.jsonl.gz"]


@pytest.mark.parametrize("vocab_text,merges_text,pattern", [
    (None, "", r"--merge-file .* holds no merges"),
    ("", None, r"--vocab-file .* is not valid JSON"),
])
def test_bad_tokenizer_files_stop_preprocessing(corpus, tmp_path, vocab_text, merges_text, pattern):
    vocab, merges = corpus["vocab"], corpus["merges"]
    if vocab_text is not None:
        vocab = str(tmp_path / "vocab.json")
        open(vocab, "w").write(vocab_text)
    if merges_text is not None:
        merges = str(tmp_path / "merges.txt")
        open(merges, "w").write(merges_text)
    with pytest.raises(SystemExit, match=pattern):
        preprocess_data.main(["--input", corpus["path"], "--output-prefix", str(tmp_path / "out"),
                              "--json-keys", "content", "--vocab-file", vocab,
                              "--merge-file", merges])
    assert not [n for n in os.listdir(tmp_path) if n.startswith("out")]


def test_assemble_drops_empty_sequences_and_ends_documents_with_eod():
    # documents 0: sequences [1 2] [] [3]; 1: [] (empty); 2: [4 5 6] -- tokens back to back
    tokens = np.array([1, 2, 3, 4, 5, 6], dtype=np.uint32)
    lengths, docs = np.array([2, 0, 1, 0, 3]), np.array([0, 0, 0, 1, 2])
    out, seq, per_doc, empty = preprocess_data.assemble(tokens, lengths, docs, 3, 9, np.uint16)
    assert out.tolist() == [1, 2, 3, 9, 4, 5, 6, 9] and out.dtype == np.uint16
    assert seq.tolist() == [2, 2, 4] and per_doc.tolist() == [2, 1] and empty == 1
    out, seq, per_doc, empty = preprocess_data.assemble(tokens, lengths, docs, 3, None, np.uint16)
    assert out.tolist() == [1, 2, 3, 4, 5, 6] and seq.tolist() == [2, 1, 3] and empty == 1


def test_parquet_input_gives_the_jsonl_output(corpus, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({"content": [d["content"] for d in corpus["docs"]],
                      "path": [d["path"] for d in corpus["docs"]]})
    parquet = str(tmp_path / "in.parquet")
    pq.write_table(table, parquet, row_group_size=7)
    run(corpus, tmp_path / "jsonl", "--workers", "2")
    run(corpus, tmp_path / "parquet", "--workers", "2", input_path=parquet)
    for ext in (".bin", ".idx"):
        assert (open(str(tmp_path / "jsonl_content_document") + ext, "rb").read()
                == open(str(tmp_path / "parquet_content_document") + ext, "rb").read())


@pytest.mark.parametrize("columns,pattern", [
    ({"text": ["a = 1"]}, r"has no column 'content' \(columns: \['text'\]\).*--json-keys"),
    ({"content": [1, 2]}, r"column 'content' holds int64, not strings"),
    ({"content": ["a = 1", None]}, r"row 2: key 'content' holds NoneType"),
])
def test_bad_parquet_names_the_file_column_and_row(corpus, tmp_path, columns, pattern):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = str(tmp_path / "bad.parquet")
    pq.write_table(pa.table(columns), path)
    with pytest.raises(SystemExit, match=pattern) as info:
        run(corpus, tmp_path / "out", input_path=path)
    assert path in str(info.value.code)
    assert sorted(os.listdir(tmp_path)) == ["bad.parquet"]


def test_the_tokenizers_fallback_writes_the_same_files(corpus, tmp_path, monkeypatch):
    """Without gigatoken (or with it: then the two runs compare its path with the fallback)
    the worker-process path writes the same bytes."""
    from app.data.tokenizer import GPT2BPETokenizer

    run(corpus, tmp_path / "fast", "--workers", "2")
    monkeypatch.setattr(GPT2BPETokenizer, "_gigatoken", lambda self: None)
    run(corpus, tmp_path / "fallback", "--workers", "2")
    for ext in (".bin", ".idx"):
        assert (open(str(tmp_path / "fast_content_document") + ext, "rb").read()
                == open(str(tmp_path / "fallback_content_document") + ext, "rb").read())
