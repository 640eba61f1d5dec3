"""The command lines of the predictor (``autotuner.predict``, ``autotuner.tune``): run directories, then
``key=value`` settings, typed by the key's kind. One parser, so both commands refuse the same slips in
the same words."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from autotuner.errors import UserError

_KINDS = {int: "an integer", float: "a number", str: "text"}


def parse_settings(items: Sequence[str], kinds: Mapping[str, type]) -> tuple[list[str], dict[str, Any]]:
    """(run directories, settings): an item without ``=`` is a directory; ``key=value`` is a setting of
    ``kinds[key]`` (int, float, bool or str). UserError (one line) for an unknown key or a value of the
    wrong type."""
    dirs, settings = [], {}
    for item in items:
        if "=" not in item:
            dirs.append(item)
            continue
        key, _, value = item.partition("=")
        kind = kinds.get(key)
        if kind is None:
            raise UserError(f"unknown setting {key!r}: use one of {', '.join(kinds)}")
        if kind is bool:
            if value.lower() not in ("true", "false"):
                raise UserError(f"{key}={value!r} must be true or false: give {key}=true or {key}=false")
            settings[key] = value.lower() == "true"
            continue
        try:
            settings[key] = kind(value)
        except ValueError:
            raise UserError(f"{key}={value!r} is not {_KINDS[kind]}: give e.g. {key}=8") from None
        if kind is float and not math.isfinite(settings[key]):  # nan passes every range check after
            raise UserError(f"{key}={value!r} is not a finite number: give e.g. {key}=8")
    return dirs, settings
