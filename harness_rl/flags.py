"""Command-line flags generated from a configuration Struct, so a setting is declared exactly once.

Every leaf field of the Struct (nested Structs are walked) becomes `--field-name`, its help is the
field's description followed by its default, its type and constraints come from the annotation, and
parsed values land back at the field's path. A field's `Meta(extra={"flag": ...})` renames its flag
(`"--proxy-port"`) or hides it (`None`). Optional fields accept the word `none`; a list field's flag
is repeated (`--tasks A --tasks B`). A long command lays its flags out in `Group`s, placed by the
section their field lives in.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import msgspec.inspect as mi

NONE_WORD = "none"


@dataclass(frozen=True)
class Flag:
    """One generated flag: where its value goes in the configuration and how it is parsed."""

    name: str  # "--num-generations"
    path: tuple[str, ...]  # ("rollouts", "num_generations")
    description: str
    type: mi.Type
    optional: bool
    default: Any
    repeated: bool = False  # a list field: each use of the flag adds one item
    required: bool = False  # an empty default a preset or the user must fill

    @property
    def default_text(self) -> str:
        """What the help says of the flag not given: its default, or that it must be given."""
        return "required" if self.required else f"default: {show(self.default)}"

    @property
    def dest(self) -> str:
        return "cfg__" + "__".join(self.path)


def flags_of(struct: type[msgspec.Struct], *, internal: bool = False,
             exclude: frozenset[str] = frozenset()) -> list[Flag]:
    """Every flag of a configuration Struct, in field order (nested Structs inline).

    Fields marked `internal` (set by whoever starts that component) get flags only when asked for:
    `serve proxy` exposes the proxy's upstream and store, `train` sets them itself. `exclude` names
    dotted field paths a command does not offer (`eval` has its own `--tasks`, not `rollouts.tasks`).
    """
    return [flag for flag in _walk(mi.type_info(struct), (), internal) if ".".join(flag.path) not in exclude]


def _walk(info: mi.Type, path: tuple[str, ...], internal: bool) -> Iterator[Flag]:
    assert isinstance(info, mi.StructType)
    for field in info.fields:
        kind, meta = field.type, {}
        if isinstance(kind, mi.Metadata):
            meta = {"description": (kind.extra_json_schema or {}).get("description", ""), **(kind.extra or {})}
            kind = kind.type
        if isinstance(kind, mi.StructType):
            yield from _walk(kind, (*path, field.name), internal)
            continue
        flag = meta.get("flag", "")
        if flag is None or isinstance(kind, mi.DictType) or (meta.get("internal") and not internal):
            continue
        optional = isinstance(kind, mi.UnionType) and any(isinstance(t, mi.NoneType) for t in kind.types)
        if optional:
            assert isinstance(kind, mi.UnionType)
            kind = next(t for t in kind.types if not isinstance(t, mi.NoneType))
        default = field.default if field.default is not mi.NODEFAULT else (
            field.default_factory() if field.default_factory is not mi.NODEFAULT else None)
        repeated = isinstance(kind, mi.ListType)
        if repeated:
            assert isinstance(kind, mi.ListType)
            kind = kind.item_type
        yield Flag(flag or "--" + field.name.replace("_", "-"), (*path, field.name),
                   str(meta.get("description", "")), kind, optional, default, repeated, bool(meta.get("required")))


@dataclass(frozen=True)
class Group:
    """One titled section of a command's help.

    `paths` names what it holds, dotted: a section (`"learner"`, all its fields, nested ones too), one
    field (`"rollouts.harness"`, wherever its section goes), or `""`, the top level's own fields. Its
    flags are listed in the order `paths` names them, field order within a section.
    """

    title: str
    paths: tuple[str, ...]


def add_flags(parser: argparse._ActionsContainer, flags: list[Flag],
              default_text: Callable[[Flag], str] | None = None) -> None:
    """Add each flag to `parser`; values not given stay absent from the namespace (argparse.SUPPRESS).

    `default_text` says what a flag not given comes to (`flag.default_text` unless given)."""
    for flag in flags:
        shown = default_text(flag) if default_text else flag.default_text
        help_text = f"{flag.description} ({shown})" if flag.description else f"({shown})"
        kwargs: dict[str, Any] = {"dest": flag.dest, "default": argparse.SUPPRESS, "help": help_text,
                                  "metavar": flag.path[-1].upper()}
        if isinstance(flag.type, mi.BoolType):
            del kwargs["metavar"]
            parser.add_argument(flag.name, action=argparse.BooleanOptionalAction, **kwargs)
            continue
        if isinstance(flag.type, mi.LiteralType):
            kwargs["choices"] = [*flag.type.values, *([NONE_WORD] if flag.optional else [])]
            kwargs["metavar"] = "{" + ",".join(map(str, kwargs["choices"])) + "}"
        if flag.repeated:
            kwargs["action"] = "append"
        parser.add_argument(flag.name, type=_parser(flag), **kwargs)


def add_flag_groups(parser: argparse.ArgumentParser, flags: list[Flag], groups: Sequence[Group],
                    default_text: Callable[[Flag], str] | None = None) -> list[argparse._ArgumentGroup]:
    """Add each flag to its group's section of the help, the sections in the order of `groups`; the sections are
    returned (in that order) for the command's own flags."""
    sections = [parser.add_argument_group(group.title) for group in groups]
    for flag in sorted(flags, key=lambda flag: _placement(flag, groups)):
        add_flags(sections[_placement(flag, groups)[0]], [flag], default_text)
    return sections


def _placement(flag: Flag, groups: Sequence[Group]) -> tuple[int, int]:
    """The flag's group and its rank there, by the most specific path a group names: the field itself, else its
    section, else each enclosing one (`""` for a top-level field)."""
    path = flag.path
    owners = [".".join(path[:n]) for n in range(len(path), 0, -1)] + ([""] if len(path) == 1 else [])
    for owner in owners:
        for index, group in enumerate(groups):
            if owner in group.paths:
                return index, group.paths.index(owner)
    raise ValueError(f"{flag.name}: no help group holds {'.'.join(path)} or a section around it")


def _parser(flag: Flag) -> Callable[[str], Any]:
    base: Callable[[str], Any]
    if isinstance(flag.type, mi.IntType):
        base = int
    elif isinstance(flag.type, mi.FloatType):
        base = float
    else:
        base = str

    def parse(text: str) -> Any:
        if flag.optional and text.lower() == NONE_WORD:
            return None
        try:
            return base(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {base.__name__}, got {text!r}") from None

    parse.__name__ = base.__name__
    return parse


def collect(namespace: argparse.Namespace, flags: list[Flag]) -> dict[str, Any]:
    """The flags given on the command line, as a nested dict keyed by field names."""
    out: dict[str, Any] = {}
    given = vars(namespace)
    for flag in flags:
        if flag.dest in given:
            node = out
            for key in flag.path[:-1]:
                node = node.setdefault(key, {})
            node[flag.path[-1]] = given[flag.dest]
    return out


def show(value: Any) -> str:
    """A value as the user would type it."""
    if value is None:
        return NONE_WORD
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, str) and not value:
        return '""'
    if isinstance(value, list):
        return ", ".join(map(str, value)) or "none"
    return str(value)


def flag_for_path(flags: list[Flag], path: str) -> str:
    """The flag that sets a msgspec error path (`$.rollouts.num_generations`), or the path itself."""
    dotted = path.removeprefix("$.").split("[")[0]
    for flag in flags:
        if ".".join(flag.path) == dotted:
            return flag.name
    return dotted
