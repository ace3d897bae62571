"""The release is named once per place a user looks (pyproject.toml, CHANGELOG.md's newest entry,
app.utils.release) and the three agree; every checkpoint's args carry it."""
import re
import tomllib

from app.checkpoint.model_args import checkpoint_args_namespace, checkpoint_writer
from app.utils.release import PROJECT, VERSION
from tests.harness.arguments import build
from tests.harness.launch import ROOT


def test_pyproject_the_changelog_and_the_code_name_the_same_release():
    with open(f"{ROOT}/pyproject.toml", "rb") as f:
        project = tomllib.load(f)["project"]
    assert (project["name"], project["version"]) == (PROJECT, VERSION)
    with open(f"{ROOT}/CHANGELOG.md", encoding="utf-8") as f:
        releases = re.findall(r"^## (\d+\.\d+\.\d+)", f.read(), flags=re.M)
    assert releases[0] == VERSION, releases
    assert releases == sorted(releases, key=lambda v: tuple(map(int, v.split("."))),
                              reverse=True)


def test_a_checkpoints_args_name_the_release_that_wrote_them():
    args = checkpoint_args_namespace(build([]), 8, 0, 2)
    assert args.writer == {"project": PROJECT, "version": VERSION}
    writer = checkpoint_writer(args)
    assert writer.ours and writer.version == VERSION
    assert writer.describe() == f"{PROJECT} {VERSION}"
