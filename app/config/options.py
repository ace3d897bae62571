"""One declaration per command-line option: the config dataclass field that holds its value.

A field declared with `option(...)` carries everything its flag needs: the spellings
(Megatron-LM's first, then older aliases such as DeepSpeedExamples' names), the help text, the
choices, and, through the field itself, the type and the default. `arguments.py` builds the
argparse parser from these fields and `from_flags` fills a config from the parsed values, so
adding an option means writing one field:

    @dataclass(kw_only=True)
    class CheckpointConfig:
        ckpt_format: str = option("--ckpt-format", default="torch", choices=CKPT_FORMATS,
                                  help="torch: Megatron's legacy files; torch_dist: ...")

Rules of the mapping (pure, no argparse here):
- the argparse `dest` is the first long spelling with dashes as underscores (Megatron's
  namespace names), unless `dest=` says otherwise; several fields may not share a dest;
- the flag's type is the field's (`Optional[X]` gives X; `List[X]` needs `nargs`); a bool field is
  a switch: `store_true` when its default is False, `--x/--no-x` when its default is True or None,
  or the `action` given (`store_false` for a `--no-...` spelling of a True default);
- a required field (no default) has a flag that defaults to `flag_default` (None): either the
  user must give it (--train-iters) or arguments.py derives the value when the flag is absent
  (--global-batch-size) and passes it to `from_flags` as an override;
- the argparse group is the class's `FLAG_GROUP` (title, description) unless `group=` names
  another title;
- `parse=f` reads the flag's text with `f` instead of the field's type (a value of several types:
  --iteration takes a number or 'release'); f raises argparse.ArgumentTypeError with its message;
- `required=True` makes argparse itself demand the flag (a tool's --load; the field then has no
  default); a list field may collect repeated flags with `action="extend"`;
- `path=PathOption(kind, what)` makes the flag name an existing file or directory: `from_flags`
  refuses a missing one (ValueError naming the flag, the path and `what` to pass) before the
  config is built, the same check for every such flag of every tool.
Values that are derived from several flags or from the DeepSpeed JSON are passed to
`from_flags` as overrides; everything else comes from the option's own flag.
"""
from __future__ import annotations

import dataclasses
import os
import typing
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Mapping, Optional, Tuple, Type

MISSING: Any = dataclasses.MISSING

SWITCH_ACTIONS = ("store_true", "store_false", "boolean_optional")
"""The `action` values a bool option may name."""
LIST_ACTIONS = ("extend",)
"""The `action` values a list option may name (`--prompt a b --prompt c` gives [a, b, c])."""


@dataclass(frozen=True)
class PathOption:
    """What a path-valued option must name: an existing `kind` ('file', 'dir' or 'any');
    `what` is the fix an error message gives ("the JSONL that pretrain_gpt2.py --metrics-file
    wrote"). `hub`: a name that may be a Hugging Face Hub name in the local cache ('gpt2',
    'org/name': relative, at most one '/', no leading '.' or '~', not a .model file) is not
    checked; `stdin`: '-' is allowed."""

    kind: str
    what: str
    hub: bool = False
    stdin: bool = False

    def __post_init__(self) -> None:
        if self.kind not in ("file", "dir", "any"):
            raise ValueError(f"PathOption kind {self.kind!r}: use 'file', 'dir' or 'any'")

    def problem(self, flag: str, value: str) -> Optional[str]:
        """Why `value` given to `flag` is not such a path (None when it is, or is not checked)."""
        if (self.stdin and value == "-") or (self.hub and _hub_name(value)):
            return None
        if not os.path.exists(value):
            return f"{flag} {value} does not exist: pass {self.what}"
        if self.kind == "file" and not os.path.isfile(value):
            return f"{flag} {value} is not a file: pass {self.what}"
        if self.kind == "dir" and not os.path.isdir(value):
            return f"{flag} {value} is not a directory: pass {self.what}"
        return None


def _hub_name(value: str) -> bool:
    """`value` may be a Hub name ('gpt2', 'org/name'), not a local path."""
    return not (value.endswith(".model") or os.path.isabs(value) or value.startswith((".", "~"))
                or value.count("/") > 1)


@dataclass(frozen=True)
class Flag:
    """How one config field appears on the command line (see the module docstring)."""

    spellings: Tuple[str, ...]
    help: Optional[str] = None
    choices: Optional[Tuple[Any, ...]] = None
    action: Optional[str] = None
    nargs: Any = None
    """argparse's nargs: '*', '+', '?' or a count."""
    metavar: Any = None
    """argparse's metavar: a name, or a tuple of names for a counted nargs."""
    parse: Any = None
    """argparse's type when the field's type cannot read the text (an int or 'release')."""
    group: Optional[str] = None
    dest_name: Optional[str] = None
    flag_default: Any = None
    """The flag's default when it differs from the field's (see `option`)."""
    has_flag_default: bool = False
    required: bool = False
    """argparse refuses a command line without the flag."""
    path: Optional[PathOption] = None
    """The value names an existing file or directory (checked by `from_flags`)."""

    @property
    def dest(self) -> str:
        """The argparse destination: `dest=` if given, else the first long spelling."""
        if self.dest_name:
            return self.dest_name
        return self.spellings[0].lstrip("-").replace("-", "_")

    @property
    def name(self) -> str:
        """The spelling error messages use: the first one."""
        return self.spellings[0]


def option(*spellings: str, default: Any = MISSING, default_factory: Any = MISSING,
           help: Optional[str] = None, choices: Optional[typing.Sequence[Any]] = None,
           action: Optional[str] = None, nargs: Any = None,
           metavar: Any = None, group: Optional[str] = None,
           dest: Optional[str] = None, flag_default: Any = MISSING,
           required: bool = False, parse: Any = None,
           path: Optional[PathOption] = None) -> Any:
    """A dataclass field that is also the command-line option `spellings[0]` (aliases after it).

    `default` / `default_factory` are the field's (and the flag's) default; leave both out for a
    derived value that arguments.py computes, whose flag then defaults to `flag_default` (None
    unless given). See the module docstring for the other arguments."""
    if not spellings or not all(s.startswith("--") for s in spellings):
        raise ValueError(f"option spellings must start with '--', got {spellings!r}")
    if action is not None and action not in SWITCH_ACTIONS + LIST_ACTIONS:
        raise ValueError(f"option {spellings[0]}: action must be one of "
                         f"{SWITCH_ACTIONS + LIST_ACTIONS}")
    if required and (default is not MISSING or default_factory is not MISSING):
        raise ValueError(f"option {spellings[0]}: a required flag has no default")
    flag = Flag(spellings=tuple(spellings), help=help,
                choices=None if choices is None else tuple(choices), action=action, nargs=nargs,
                metavar=metavar, parse=parse, group=group, dest_name=dest,
                flag_default=None if flag_default is MISSING else flag_default,
                has_flag_default=flag_default is not MISSING, required=required, path=path)
    return dataclasses.field(default=default, default_factory=default_factory,
                             metadata={"flag": flag})


@dataclass(frozen=True)
class Option:
    """One option found in a config class tree: where its value lives and how it is spelled."""

    path: Tuple[str, ...]
    """Field names from the root class down to the field (("model", "num_layers"))."""
    owner: Type[Any]
    """The dataclass that declares the field."""
    field: dataclasses.Field
    flag: Flag
    value_type: Any
    """The field's resolved type (`Optional[int]`, `List[str]`, `bool`, ...)."""

    @property
    def default(self) -> Any:
        """The flag's default: the field's default (a fresh one from its factory), else the
        declared flag_default, else None."""
        if self.flag.has_flag_default:
            return self.flag.flag_default
        if self.field.default is not MISSING:
            return self.field.default
        if self.field.default_factory is not MISSING:
            return self.field.default_factory()
        return None

    @property
    def scalar_type(self) -> Any:
        """The type of one value: X for Optional[X], List[X] and Optional[List[X]], else the
        field's type."""
        kind = self.value_type
        while typing.get_origin(kind) in (typing.Union, list, List):
            args = [a for a in typing.get_args(kind) if a is not type(None)]
            if not args:
                break
            kind = args[0]
        return kind

    @property
    def group_title(self) -> str:
        return self.flag.group or flag_group(self.owner)[0]


def flag_group(cls: Type[Any]) -> Tuple[str, str]:
    """(title, description) of the argparse group of `cls`'s options: its FLAG_GROUP, else its
    name with the first line of its docstring."""
    group = getattr(cls, "FLAG_GROUP", None)
    if group:
        return group
    doc = (cls.__doc__ or "").strip().splitlines()
    return cls.__name__, doc[0] if doc else ""


def _is_config(kind: Any) -> bool:
    return isinstance(kind, type) and dataclasses.is_dataclass(kind)


def iter_options(root: Type[Any], path: Tuple[str, ...] = ()) -> Iterator[Option]:
    """Every option of `root` and of the config dataclasses it holds, in declaration order."""
    hints = typing.get_type_hints(root)
    for f in dataclasses.fields(root):
        if not f.init:  # derived in __post_init__, never a flag
            continue
        kind = hints[f.name]
        flag = f.metadata.get("flag")
        if flag is not None:
            yield Option(path + (f.name,), root, f, flag, kind)
        elif _is_config(kind):
            yield from iter_options(kind, path + (f.name,))


def check_unique(options: typing.Iterable[Option]) -> None:
    """Raise naming both fields when two options share a spelling or a dest (a declaration
    error, found when the parser is built)."""
    seen: Dict[str, Option] = {}
    for opt in options:
        for key in (*opt.flag.spellings, "dest " + opt.flag.dest):
            other = seen.get(key)
            if other is not None:
                raise ValueError(f"{key} is declared twice: {'.'.join(other.path)} and "
                                 f"{'.'.join(opt.path)}")
            seen[key] = opt


def check_path(flag: Flag, value: Any) -> None:
    """ValueError (a usage error) when `flag` declares a PathOption and `value` (or an item of
    a list value) does not name such a path."""
    if flag.path is None or value is None:
        return
    for item in value if isinstance(value, (list, tuple)) else [value]:
        problem = flag.path.problem(flag.name, str(item))
        if problem:
            raise ValueError(problem)


def from_flags(cls: Type[Any], values: Mapping[str, Any], **overrides: Any) -> Any:
    """An instance of config class `cls` built from parsed flags (`values`, keyed by dest).

    Each option field takes its flag's value, unless `overrides` names it (a derived value).
    A field holding a nested config class is built the same way, recursively; its override may
    be a ready instance or a dict of overrides for its own fields. Other fields keep their
    defaults; fields with init=False are derived by the class itself. A required field (an
    option without a default) takes its flag's value when the flag was given, else it must be
    overridden (a derived value). A flag's value that does not name the path its PathOption
    asks for is a ValueError (check_path)."""
    hints = typing.get_type_hints(cls)
    kwargs: Dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if not f.init:  # derived in __post_init__
            continue
        given = overrides.pop(f.name, MISSING)
        flag = f.metadata.get("flag")
        if _is_config(hints[f.name]) and flag is None:
            if given is MISSING or isinstance(given, Mapping):
                given = from_flags(hints[f.name], values, **({} if given is MISSING else given))
            kwargs[f.name] = given
        elif given is not MISSING:
            kwargs[f.name] = given
        elif flag is not None:
            value = values.get(flag.dest, MISSING)
            required = f.default is MISSING and f.default_factory is MISSING
            if required and value in (MISSING, None):
                raise TypeError(f"{cls.__name__}.{f.name} ({flag.name}) has no default: give "
                                "the flag or pass the value as an override")
            if value is not MISSING:
                check_path(flag, value)
                kwargs[f.name] = list(value) if isinstance(value, (list, tuple)) else value
    if overrides:
        raise TypeError(f"{cls.__name__} has no fields {sorted(overrides)}")
    return cls(**kwargs)


def option_values(config: Any) -> Dict[str, Any]:
    """{dest: value} of the option fields of one config instance (not nested ones): what the
    command line would have to say to rebuild it."""
    return {f.metadata["flag"].dest: getattr(config, f.name)
            for f in dataclasses.fields(config) if "flag" in f.metadata}
