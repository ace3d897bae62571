"""app/config/options.py and the parser arguments.py generates from it.

- Every recorded flag (tests/data/recorded_flags.json, read from the hand-written parser the
  generated one replaced) is still accepted, spelling by spelling, with the same dest, default,
  help, choices and action.
- A config class written only with `option()` fields becomes flags and comes back as the config
  (switches, --x/--no-x, store_false, lists, choices, aliases, nested configs, derived fields).
"""
import argparse
import json
import pathlib
from dataclasses import dataclass, field
from typing import ClassVar, List, Optional, Tuple

import pytest

import arguments
from app.config.options import check_unique, from_flags, iter_options, option

RECORDED = pathlib.Path(__file__).resolve().parents[1] / "data" / "recorded_flags.json"
KINDS = {"_StoreAction": argparse._StoreAction, "_StoreTrueAction": argparse._StoreTrueAction,
         "_StoreFalseAction": argparse._StoreFalseAction,
         "BooleanOptionalAction": argparse.BooleanOptionalAction}


def _recorded():
    return json.loads(RECORDED.read_text())["flags"]


@pytest.fixture(scope="module")
def actions():
    parser = arguments.build_parser()
    return parser, {s: a for a in parser._actions for s in a.option_strings}


@pytest.mark.parametrize("old", _recorded(), ids=lambda x: x["flags"][0])
def test_recorded_flag_keeps_its_meaning(actions, old):
    _, by_spelling = actions
    for spelling in old["flags"]:
        assert spelling in by_spelling, f"{spelling} is no longer accepted"
        action = by_spelling[spelling]
        assert action.dest == old["dest"]
        assert action.default == old["default"]
        if old["help"] is not None:  # what the help said still holds (new choices appended)
            assert action.help.startswith(old["help"])
        assert set(action.choices or []) >= set(old["choices"] or [])
        assert action.nargs == old["nargs"]
        kind = KINDS.get(old["kind"], object)  # a switch may have gained its --no- spelling
        assert isinstance(action, kind) or (kind is argparse._StoreTrueAction and isinstance(
            action, argparse.BooleanOptionalAction) and spelling in action.option_strings[:1])
        if old["type"] is not None:  # None and str both leave the string as it is
            assert getattr(action.type, "__name__", None) == old["type"]


def test_recorded_command_line_parses_to_the_same_values(actions):
    parser, _ = actions
    argv = ["--model-parallel-size", "2", "--batch-size", "3", "--warmup", "0.1",
            "--no-layernorm-fusion", "--muon-no-split-qkv", "--data-path", "0.3", "a", "0.7", "b",
            "--exit-signal-handler", "--min-scale", "2", "--local_rank", "1"]
    args = parser.parse_args(argv)
    assert (args.tensor_model_parallel_size, args.micro_batch_size, args.lr_warmup_fraction,
            args.layernorm_fusion, args.muon_split_qkv, args.data_path,
            args.exit_signal_handler, args.min_loss_scale, args.local_rank) == \
        (2, 3, 0.1, False, False, ["0.3", "a", "0.7", "b"], True, 2.0, 1)


# ---------------------------------------------------------------------------- a new config

@dataclass(kw_only=True)
class Inner:
    FLAG_GROUP: ClassVar[Tuple[str, str]] = ("inner", "a nested config")

    depth: int = option("--depth", "--old-depth", default=3, help="how deep")
    fast: bool = option("--fast", default=True, help="on unless --no-fast")


@dataclass(kw_only=True)
class Outer:
    FLAG_GROUP: ClassVar[Tuple[str, str]] = ("outer", "the root")

    inner: Inner = field(default_factory=Inner)
    mode: str = option("--mode", default="a", choices=("a", "b"))
    paths: List[str] = option("--paths", default_factory=list, nargs="*")
    quiet: bool = option("--quiet", default=False)
    keep: bool = option("--no-keep", default=True, action="store_false", dest="keep")
    limit: Optional[float] = option("--limit", default=None)
    total: int = option("--total", help="derived unless given")
    note: str = "not a flag"


def test_a_new_config_becomes_flags_and_comes_back():
    parser = arguments.build_parser(roots=(Outer,))
    args = parser.parse_args(["--old-depth", "5", "--no-fast", "--mode", "b", "--paths", "x", "y",
                              "--quiet", "--no-keep", "--limit", "0.5"])
    built = from_flags(Outer, vars(args), total=7)
    assert built == Outer(inner=Inner(depth=5, fast=False), mode="b", paths=["x", "y"],
                          quiet=True, keep=False, limit=0.5, total=7)
    defaults = from_flags(Outer, vars(parser.parse_args([])), total=1, inner={"depth": 9})
    assert defaults == Outer(inner=Inner(depth=9), total=1)
    assert args.total is None  # a derived field's flag defaults to None
    titles = [g.title for g in parser._action_groups]
    assert "outer" in titles and "inner" in titles


def test_choices_and_types_are_enforced_by_the_parser(capsys):
    parser = arguments.build_parser(roots=(Outer,))
    for bad in (["--mode", "c"], ["--depth", "two"]):
        with pytest.raises(SystemExit) as exit_info:
            parser.parse_args(bad)
        assert exit_info.value.code == 2
        assert bad[0] in capsys.readouterr().err


def test_derived_field_must_be_given_and_unknown_overrides_refused():
    values = vars(arguments.build_parser(roots=(Outer,)).parse_args([]))
    with pytest.raises(TypeError, match="--total.*has no default"):
        from_flags(Outer, values)
    with pytest.raises(TypeError, match="nosuch"):
        from_flags(Outer, values, total=1, nosuch=2)


def test_a_spelling_declared_twice_is_refused():
    @dataclass(kw_only=True)
    class Twice:
        first: int = option("--same", default=1)
        second: int = option("--other", "--same", default=2)

    with pytest.raises(ValueError, match="--same is declared twice"):
        check_unique(iter_options(Twice))

