import os, shutil
from tests.harness.distributed import run_pretrain
from tests.integration.conftest import tiny_gpt_args
from tests.integration.test_chaos import RUN, final_tensors, last_logged, local_args, ROOT, TRAIN_ITERS

def test_ds(tiny_corpus, tmp_path):
    ds = ["--deepspeed", "--deepspeed_config", os.path.join(ROOT, "ds_configs", os.environ.get("DSCFG", "zero2.json"))]
    ref = tmp_path / "ref"
    run_pretrain(2, tiny_gpt_args(tiny_corpus, tmp_path, *RUN, *ds, "--save", str(ref), "--metrics-file", str(tmp_path / "ref.jsonl")))
    rep = local_args(tmp_path, "--replication", "--replication-jump", "1", "--replication-factor", "2")
    m = tmp_path / "m.jsonl"
    run_pretrain(2, tiny_gpt_args(tiny_corpus, tmp_path, *RUN, *ds, "--exit-interval", "7", "--metrics-file", str(m), *rep))
    shutil.rmtree(tmp_path / "local" / "rank_1")
    ck = str(tmp_path / "ck")
    logs = run_pretrain(2, tiny_gpt_args(tiny_corpus, tmp_path, *RUN, *ds, "--save", ck, "--load", ck, "--save-interval", "5", "--metrics-file", str(m), *rep))
    assert "resuming from the local checkpoint of iteration 6" in logs[0], logs[0][-5000:]
    got, want = last_logged(m), last_logged(tmp_path / "ref.jsonl")
    assert got == want, (got, want)
    g, w = final_tensors(ck), final_tensors(str(ref))
    assert sorted(g) == sorted(w)
    bad = [k for k in w if not w[k].equal(g[k])]
    assert not bad, bad
