"""The one exception type for bad input: the CLI prints it as one line and exits with code 2."""

from __future__ import annotations

import argparse
import sys
from typing import Any, NoReturn


class UserError(Exception):
    """Bad input the user can fix. The message names the problem and the fix, on one line."""

    exit_code = 2


def short_repr(value: object, limit: int = 40) -> str:
    """``repr(value)`` cut to ``limit`` characters, to quote a bad value inside a one-line message."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# What a value of the wrong JSON/YAML type should have been, by pydantic's error type.
_WANTS = {
    "dict_type": "a mapping",
    "model_type": "a mapping",
    "list_type": "a list",
    "string_type": "a string",
    "int_type": "an integer",
    "int_parsing": "an integer",
    "bool_type": "true or false",
    "bool_parsing": "true or false",
    "float_type": "a number",
    "float_parsing": "a number",
}


def schema_problem(error: Any) -> str:
    """The first problem of a pydantic ``ValidationError`` as one line: where it is (``calls[3].count``,
    ``hf_config key 1``; nothing for the whole document) and what is wrong, in the words of our other
    refusals ("must be a mapping, not list [1, 2]"). Callers add the file and the fix. Takes the error
    duck-typed so that this module, imported by everything, does not import pydantic."""
    problems = error.errors(include_url=False)
    first = problems[0]
    kind, ctx, given = first["type"], first.get("ctx") or {}, first.get("input")
    loc = list(first["loc"])
    where = ""
    for index, part in enumerate(loc):
        if part == "[key]":
            continue
        if loc[index + 1 : index + 2] == ["[key]"]:  # pydantic puts "[key]" after a bad mapping key
            where += f" key {part!r}"
        elif isinstance(part, int):
            where += f"[{part}]"
        else:
            where += f".{part}" if where else str(part)
    if kind in _WANTS:
        problem = f"must be {_WANTS[kind]}, not {type(given).__name__} {short_repr(given)}"
    elif kind == "greater_than_equal":
        problem = f"must be at least {ctx.get('ge')}, not {short_repr(given)}"
    elif kind == "greater_than":
        problem = f"must be above {ctx.get('gt')}, not {short_repr(given)}"
    elif kind == "finite_number":
        problem = f"must be a finite number, not {short_repr(given)}"
    elif kind == "literal_error":
        problem = f"must be one of {ctx.get('expected')}, not {short_repr(given)}"
    elif kind in ("too_short", "too_long"):
        bound = (
            f"at least {ctx.get('min_length')}" if kind == "too_short" else f"at most {ctx.get('max_length')}"
        )
        problem = f"must have {bound} item(s), not {ctx.get('actual_length')}"
    elif kind == "string_too_short":
        problem = "must not be empty"
    elif kind == "missing":
        problem = "is missing"
    elif kind == "extra_forbidden":
        problem = "is an unknown key"
    elif kind == "value_error":
        problem = str(ctx.get("error", first["msg"]))
    else:
        problem = first["msg"][:1].lower() + first["msg"][1:]
    more = f" (and {len(problems) - 1} more problem(s))" if len(problems) > 1 else ""
    return f"{where} {problem}{more}".strip()


class OneLineParser(argparse.ArgumentParser):
    """The tools' argument parser: bad arguments are one line on stderr and exit code 2, as every other bad
    input (argparse's own error prints the whole usage first)."""

    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: error: {message} (see --help)", file=sys.stderr)
        raise SystemExit(2)


def one_line(exc: BaseException) -> str:
    """An exception as one line: its type and the first line of its message (for a row's ``error``)."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".strip()


def say_error(prog: str, message: object) -> int:
    """Print ``<prog>: error: <message>`` on stderr, the one line every command ends bad input with;
    return the exit status for it (a UserError's own, else 2)."""
    print(f"{prog}: error: {message}", file=sys.stderr)
    return getattr(message, "exit_code", 2)
