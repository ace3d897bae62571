"""argparse parsers generated from option fields: the one place where a config field
(`app.config.options.option`) becomes a flag, for the trainer's parser (arguments.py) and the
tools' (tools/*.py).

A tool declares its own options as one config dataclass, nesting the shared ones (the
checkpoint an inference tool runs: `app.config.inference.InferenceLoadConfig`), and reads its
command line with `parse_config(Options, argv, description)`: one flag per field, the parsed
values made into the config by `from_flags`, and a ValueError from the config's checks reported
as argparse reports a bad flag (usage, the message, exit status 2). Library code never sees
argparse: it takes the config.
"""
from __future__ import annotations

import argparse
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Type, TypeVar

from app.config.options import Option, check_unique, flag_group, from_flags, iter_options

T = TypeVar("T")


def collect_options(roots: Iterable[Type[Any]]) -> List[Option]:
    """Every option of the config classes `roots`, in declaration order; ValueError when a
    spelling or a dest is declared twice."""
    options = [opt for root in roots for opt in iter_options(root)]
    check_unique(options)
    return options


def group_descriptions(options: Iterable[Option]) -> Dict[str, str]:
    """{group title: description} from the FLAG_GROUP of every class that declares options."""
    return dict(flag_group(opt.owner) for opt in options)


def add_option(group: Any, opt: Option) -> None:
    """One add_argument from one field (the rules are in app.config.options)."""
    flag = opt.flag
    kwargs: Dict[str, Any] = dict(dest=flag.dest, default=opt.default, help=flag.help)
    if flag.required:
        kwargs["required"] = True
    if opt.scalar_type is bool:
        action = flag.action or ("store_true" if opt.default is False else "boolean_optional")
        kwargs["action"] = (argparse.BooleanOptionalAction if action == "boolean_optional"
                            else action)
    else:
        kwargs.update(type=flag.parse or opt.scalar_type, choices=flag.choices, nargs=flag.nargs,
                      metavar=flag.metavar)
        if flag.action:
            kwargs["action"] = flag.action
    group.add_argument(*flag.spellings, **kwargs)


def add_options(parser: argparse.ArgumentParser, options: Iterable[Option],
                descriptions: Optional[Mapping[str, str]] = None) -> Dict[str, Any]:
    """Add each option to its argument group (made on first use, in option order, described
    by `descriptions`, default: the options' own `group_descriptions`); returns {title: group}."""
    options = list(options)
    if descriptions is None:
        descriptions = group_descriptions(options)
    groups: Dict[str, Any] = {}
    for opt in options:
        title = opt.group_title
        if title not in groups:
            groups[title] = parser.add_argument_group(title, descriptions.get(title))
        add_option(groups[title], opt)
    return groups


def tool_parser(options_class: Type[Any], description: str) -> argparse.ArgumentParser:
    """A tool's parser: one flag per option field of `options_class` and the configs it holds."""
    parser = argparse.ArgumentParser(description=description)
    add_options(parser, collect_options([options_class]))
    return parser


def parse_config(options_class: Type[T], argv: Optional[Sequence[str]],
                 description: str) -> T:
    """`options_class` built from `argv` (default sys.argv[1:]); a bad or missing flag, or a
    ValueError from the config's checks, exits with status 2 and the message, as argparse does."""
    parser = tool_parser(options_class, description)
    values = vars(parser.parse_args(argv))
    try:
        return from_flags(options_class, values)
    except ValueError as exc:
        parser.error(str(exc))
        raise  # unreachable: parser.error exits
