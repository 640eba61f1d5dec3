"""The command lines' one grammar: the command's paths, then ``key=value`` settings written as Hydra's
overrides are (``labels=[main,branch]``, ``digits=4``, ``out=DIR``), typed by a dataclass of the command's
settings whose fields carry their meaning. ``autotuner`` is itself a Hydra app; every other command parses
with :func:`parse`, so a setting is written the same way in all of them, ``--help`` lists each with its
meaning and default, and a slip (an unknown key, a value of the wrong type) is one line naming the key
and the fix, exit code 2.

An argument with ``=`` before any ``/`` is a setting, any other a path; ``--`` ends the settings (a path
holding ``=``, a command to run after it).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import re
import sys
import types
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from autotuner.errors import UserError, say_error

T = TypeVar("T")
_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def setting(default: Any, meaning: str, metavar: str = "") -> Any:
    """A settings dataclass field: its default, its meaning for ``--help`` (``metavar`` names its value)."""
    return dataclasses.field(default=default, metadata={"meaning": meaning, "metavar": metavar})


@dataclass(frozen=True)
class Command:
    """A command's grammar: its console name, its module, one line of what it does, its paths (a name
    for ``--help``, how many: ``paths`` at least, ``most`` at most, None: any) and its settings class."""

    name: str
    module: str
    summary: str
    paths: str
    settings: type
    least: int = 1
    most: int | None = None
    epilog: str = ""
    trailing: str = ""  # what follows ``--`` (a command to run)

    def usage(self) -> str:
        more = " ..." if self.most is None or self.most > 1 else ""
        paths = f"{self.paths}{more}" if self.paths else ""
        paths = f"[{paths}] " if paths and self.least == 0 else f"{paths} " if paths else ""
        trailing = f" -- {self.trailing}" if self.trailing else ""
        return f"usage: {self.name} {paths}[KEY=VALUE ...]{trailing}   (or: python -m {self.module})"

    def help(self) -> str:
        """The command's help: usage, what it does, every setting with its meaning and default."""
        lines = [self.usage(), "", self.summary, "", "settings (KEY=VALUE, as Hydra overrides are written):"]
        for f in dataclasses.fields(self.settings):
            meaning, metavar = f.metadata.get("meaning", ""), f.metadata.get("metavar") or "VALUE"
            default = "" if f.default is None else f" (default {_shown(f.default)})"
            lines.append(f"  {f.name}={metavar}")
            lines.append(f"      {meaning}{default}")
        if self.epilog:
            lines += ["", self.epilog]
        return "\n".join(lines)


def _shown(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(map(str, value)) + "]"
    return str(value)


def split(argv: Sequence[str]) -> tuple[list[str], list[str], list[str]]:
    """(paths, settings, after ``--``) of ``argv``."""
    paths, settings, rest = [], [], []
    items = list(argv)
    if "--" in items:
        cut = items.index("--")
        items, rest = items[:cut], items[cut + 1 :]
    for item in items:
        key, equals, _ = item.partition("=")
        if equals and _KEY.fullmatch(key):
            settings.append(item)
        else:
            paths.append(item)
    return paths, settings, rest


def _value(key: str, text: str) -> Any:
    """A value as Hydra's override grammar reads it: numbers, true/false, null, [lists], quoted strings;
    text it cannot read is kept as given (a path)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        override = OverridesParser.create().parse_override(f"{key}={text}")
    except Exception:  # noqa: BLE001 - Hydra's grammar errors are its own types
        return text
    if override.is_sweep_override():
        raise UserError(f"{key}={text} is a sweep in Hydra's grammar: write a list as {key}=[{text}]")
    return override.value()


def _kinds(kind: Any) -> tuple[Any, ...]:
    return typing.get_args(kind) if typing.get_origin(kind) in (typing.Union, types.UnionType) else (kind,)


def _accepts(kind: Any, value: Any) -> bool:
    if len(_kinds(kind)) > 1:
        return any(_accepts(one, value) for one in _kinds(kind))
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is type(None):
        return value is None
    if kind is bool:
        return isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind is float:
        return number
    if kind is str:
        return isinstance(value, str) or number
    if typing.get_origin(kind) is list:
        return isinstance(value, list) and all(_accepts(typing.get_args(kind)[0], v) for v in value)
    return True


def _convert(kind: Any, value: Any) -> Any:
    """``value`` as the field holds it: a number given for text is its text, an integer for a float a
    float."""
    kinds = _kinds(kind)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return value
    if str in kinds and int not in kinds and float not in kinds:
        return str(value)
    if float in kinds and int not in kinds:
        return float(value)
    return value


def _describe(kind: Any) -> str:
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    names = {bool: "true or false", int: "an integer", float: "a number", str: "text", type(None): "null"}
    if kind in names:
        return names[kind]
    if origin is list:
        return f"a list of {_describe(args[0])} ([a,b])"
    if args:
        return " or ".join(_describe(arg) for arg in args)
    return str(kind)


def settings_of(cls: type[T], items: Sequence[str], prog: str) -> T:
    """The settings ``items`` (``key=value``) give, over ``cls``'s defaults; UserError (one line) for an
    unknown key (naming the closest) or a value of the wrong type."""
    kinds = typing.get_type_hints(cls)
    given: dict[str, Any] = {}
    for item in items:
        key, _, text = item.partition("=")
        if key not in kinds:
            close = difflib.get_close_matches(key, kinds, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise UserError(f"unknown setting {key!r}{hint}: {prog}'s settings are {', '.join(kinds)}")
        value = _value(key, text)
        if not _accepts(kinds[key], value):
            raise UserError(
                f"{key}={text!r} is not {_describe(kinds[key])}: give {key}=<{_describe(kinds[key])}>"
            )
        if isinstance(value, float) and not math.isfinite(value):  # nan passes every range check after
            raise UserError(f"{key}={text} is not a finite number: give e.g. {key}=8")
        given[key] = _convert(kinds[key], value)
    return cls(**given)


class UsageError(UserError):
    """Arguments the command's grammar does not take (the message names the fix)."""


def entry(command: Command) -> Callable[[Callable[..., int]], Callable[..., int]]:
    """A command's ``main``: bad arguments (:func:`parse`'s UsageError) and any other UserError are one
    line on stderr and its exit status (2), returned as ``main``'s own."""

    def wrap(main: Callable[..., int]) -> Callable[..., int]:
        @functools.wraps(main)
        def run(*args: Any, **kwargs: Any) -> int:
            try:
                return main(*args, **kwargs)
            except UsageError as exc:
                return say_error(command.name, f"{exc} (see --help)")
            except UserError as exc:  # bad input found past the arguments: its own one line
                return say_error(command.name, exc)

        return run

    return wrap


def parse(command: Command, argv: Sequence[str] | None) -> tuple[list[str], Any, list[str]]:
    """(paths, settings, the arguments after ``--``) of the command line; ``--help`` prints the help and
    exits 0; bad arguments raise :class:`UsageError` (``main`` under :func:`entry` returns 2 for it)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    before = argv[: argv.index("--")] if "--" in argv else argv
    if any(a in ("-h", "--help") for a in before):
        print(command.help())
        raise SystemExit(0)
    paths, items, rest = split(argv)
    flags = [p for p in paths if p.startswith("-")]
    if flags:
        key = flags[0].lstrip("-").replace("-", "_")
        raise UsageError(f"{flags[0]}: settings are written key=value ({key}=...), not as flags")
    if len(paths) < command.least:
        raise UsageError(f"give {command.paths}" + (" (one or more)" if command.most != 1 else ""))
    if command.most is not None and len(paths) > command.most:
        raise UsageError(f"{len(paths)} paths given, {command.most} at most: {' '.join(paths)}")
    try:
        settings = settings_of(command.settings, items, command.name)
    except UserError as exc:
        raise UsageError(str(exc)) from None
    return paths, settings, rest
