"""scripts/lib/deepspeed_ops.py, which the test set-up (scripts/setup_env.sh --with-test-deps) runs
in the background to build DeepSpeed's CPU ops while pip installs the test requirements. Its
builds themselves are exercised by every run of scripts/test.sh on a fresh environment (the
suite's DeepSpeed tests then load the ops it built); here, the two ways it must not build: an op
whose lock a killed build left behind (it would wait for ever, as every DeepSpeed start then
does) is reported with the fix and fails the helper, and a builder DeepSpeed has no use for on
this machine is skipped."""
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _helper():
    spec = importlib.util.spec_from_file_location(
        "deepspeed_ops", ROOT / "scripts" / "lib" / "deepspeed_ops.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_stale_lock_is_reported_not_waited_on_and_an_unknown_op_is_skipped(
        tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    lock = tmp_path / "deepspeed_shm_comm" / "lock"
    lock.parent.mkdir()
    lock.write_text("")  # as torch's FileBaton leaves it when its builder is killed
    status = _helper().build(["ShareMemCommBuilder", "NoSuchBuilder"])
    out = [line for line in capsys.readouterr().out.splitlines()
           if line.startswith("[deepspeed_ops]")]  # not DeepSpeed's own start-up warnings
    assert status == 1 and len(out) == 2, out
    assert out[0].startswith("[deepspeed_ops] ShareMemCommBuilder: not built: the torch "
                             f"extension build lock {lock} "), out
    assert "is held by no process on this host" in out[0] and out[0].endswith(f"rm {lock}")
    assert out[1] == ("[deepspeed_ops] NoSuchBuilder: DeepSpeed does not load it on this machine "
                      "(accelerator cpu), skipped"), out
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["deepspeed_shm_comm", "lock"]
