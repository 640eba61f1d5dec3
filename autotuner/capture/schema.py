"""The capture file: versioned JSON, written atomically, validated on load.

A capture is one JSON object (never pickle: a capture can be read, diffed and shared safely)::

    {
      "format": "autotuner-capture",          # always this string
      "version": 1,                           # bumped whenever a field changes meaning
      "created": "2026-01-31T12:00:00+00:00", # when the file was written (UTC)
      "command": ["train.py", "--lr", "1e-3"],# the program's sys.argv when the file was written
      "environment": {...},                   # versions, device, threads (model.runtime.environment)
      "settings": {"steps": [1, 3] | null, "functions": [...], "methods": [...],
                   "torch_compile": "ran eagerly ..."},  # only when a torch.compile'd model ran
      "steps": {"seen": 3, "captured": 2},    # optimizer steps the program made / made inside the window
      "status": "complete",                   # complete | exit | exception | interrupted | signal
      "error": null,                          # one line when status is not complete
      "calls": [CALL, ...]
    }

Each CALL is one distinct signature of one callee at one module path, with how often it was called::

    {
      "kind": "module" | "function" | "method",
      "callee": "torch.nn.functional.linear",        # modules: the class, e.g. transformers...LlamaRMSNorm
      "base": "torch.nn.modules.linear.Linear",      # modules: nearest torch.nn/megatron.core class (not
                                                     # nn.Module itself) in the class's MRO, or null
      "path": "model.layers.0.self_attn.q_proj",     # module path ("" = the outermost module called)
      "args": [VALUE, ...], "kwargs": {"name": VALUE},
      "attrs": {"in_features": 64, ...},             # modules: constructor-relevant attributes
      "training": true,                              # modules: module.training at the call
      "grad_enabled": true,                          # torch.is_grad_enabled() at the call
      "count": 2
    }

A VALUE is one of:
``{"tensor": {"shape", "dtype", "device", "stride", "contiguous", "requires_grad", "parameter"}}``;
``{"value": scalar}`` (null, bool, int, finite float, str); ``{"float": "inf"|"-inf"|"nan"}``;
``{"tuple": [VALUE...]}``, ``{"list": [VALUE...]}``, ``{"dict": {key: VALUE}}``; ``{"dtype": "float32"}``;
``{"device": "cuda:0"}``; or ``{"object": "module.Class"}`` (anything else: only its type is kept; a
sequence longer than 64 items becomes ``{"object": "tuple", "length": n}``).

Method calls list ``self`` as their first argument. Function and method calls are recorded at the
outermost level only: a wrapped function called by another wrapped function is part of the outer call.
A module that the outermost module does not hold (say one global instance that every layer calls) is named
after its caller at each call, ``<caller path>.~<Class>``, and its children ``<caller path>.~<Class>.<name>``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from autotuner.errors import UserError, schema_problem
from autotuner.results.atomic import atomic_write_text

FORMAT = "autotuner-capture"
VERSION = 1
KINDS = ("module", "function", "method")
STATUSES = ("complete", "exit", "exception", "interrupted", "signal")


@dataclass(frozen=True)
class CallRecord:
    """One distinct (callee, module path, signature) and its call count."""

    kind: str
    callee: str
    path: str
    args: list[dict[str, Any]]
    kwargs: dict[str, dict[str, Any]]
    count: int
    grad_enabled: bool = True
    base: str | None = None
    attrs: dict[str, Any] = field(default_factory=dict)
    training: bool | None = None

    @property
    def class_name(self) -> str:
        """The short class (modules) or function name."""
        return self.callee.rsplit(".", 1)[-1]

    @property
    def base_name(self) -> str | None:
        """The short name of ``base``: the torch.nn or Megatron-Core class this module is or derives from."""
        return self.base.rsplit(".", 1)[-1] if self.base else None

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "kind": self.kind,
            "callee": self.callee,
            "path": self.path,
            "args": self.args,
            "kwargs": self.kwargs,
            "grad_enabled": self.grad_enabled,
            "count": self.count,
        }
        if self.kind == "module":
            data.update(base=self.base, attrs=self.attrs, training=self.training)
        return data


@dataclass(frozen=True)
class Capture:
    """A loaded capture file."""

    path: Path
    calls: list[CallRecord]
    steps_seen: int = 0
    steps_captured: int = 0
    window: tuple[int, int] | None = None
    status: str = "complete"
    error: str | None = None
    command: list[str] = field(default_factory=list)
    environment: dict[str, Any] = field(default_factory=dict)
    settings: dict[str, Any] = field(default_factory=dict)

    @property
    def total_calls(self) -> int:
        return sum(c.count for c in self.calls)


def dump(data: dict[str, Any], path: str | os.PathLike[str]) -> None:
    """Write ``data`` as JSON to ``path`` atomically (autotuner.results.atomic), so a reader (or a crash
    half-way) never sees a half-written capture. Non-finite floats must already be encoded
    (``allow_nan=False`` refuses them rather than write non-standard JSON)."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(target, json.dumps(data, indent=1, allow_nan=False) + "\n")


class _CallFile(BaseModel):
    """The schema of one CALL. Strict: JSON types as :class:`Recorder` writes them, nothing coerced (a
    count of "3" or true is a damaged file, not a count)."""

    model_config = ConfigDict(strict=True)

    kind: Literal[KINDS]  # type: ignore[valid-type]
    callee: str
    path: str
    args: list[Any]
    kwargs: dict[str, Any]
    count: Annotated[int, Field(ge=1)]
    grad_enabled: bool = True
    base: str | None = None
    attrs: dict[str, Any] | None = None
    training: bool | None = None


class _StepsFile(BaseModel):
    model_config = ConfigDict(strict=True)

    seen: Annotated[int, Field(ge=0)] = 0
    captured: Annotated[int, Field(ge=0)] = 0


class _SettingsFile(BaseModel):
    # The recording's other settings (functions, methods) are kept as written.
    model_config = ConfigDict(strict=True, extra="allow")

    steps: Annotated[list[int], Field(min_length=2, max_length=2)] | None = None


class _CaptureFile(BaseModel):
    """The schema of the file's body, once ``format`` and ``version`` (checked first, with messages of
    their own) say which schema applies."""

    model_config = ConfigDict(strict=True)

    calls: list[_CallFile]
    steps: _StepsFile = _StepsFile()
    settings: _SettingsFile = _SettingsFile()
    status: Literal[STATUSES] = "complete"  # type: ignore[valid-type]
    error: str | None = None
    command: list[str] = []
    environment: dict[str, Any] = {}


def _bad(path: Path, problem: str) -> UserError:
    return UserError(f"capture file {path}: {problem}: capture it again with python -m autotuner.capture")


def load(path: str | os.PathLike[str]) -> Capture:
    """Read and validate a capture file. Anything wrong is a one-line UserError naming the file, the
    field (``calls[3].count``) and the problem."""
    source = Path(path)
    try:
        text = source.read_text(encoding="utf-8")
    except OSError as exc:
        raise UserError(
            f"cannot read capture file {source}: {exc.strerror or exc}: pass the file "
            "autotuner-capture out= wrote"
        ) from exc
    try:
        data = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        where = f" (line {exc.lineno} column {exc.colno})" if isinstance(exc, json.JSONDecodeError) else ""
        raise _bad(source, f"not valid JSON{where}") from exc
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise UserError(
            f'{source} is not an autotuner capture (no "format": "{FORMAT}"): '
            "pass a file written by python -m autotuner.capture"
        )
    version = data.get("version")
    if version != VERSION:
        raise UserError(
            f"capture file {source} has version {version!r}, this autotuner reads version {VERSION}: "
            "capture it again with this autotuner, or use the autotuner that wrote it"
        )
    try:
        body = _CaptureFile.model_validate(data)
    except ValidationError as exc:
        raise _bad(source, schema_problem(exc)) from None
    calls = [CallRecord(**call.model_dump(exclude={"attrs"}), attrs=call.attrs or {}) for call in body.calls]
    window = body.settings.steps
    return Capture(
        path=source,
        calls=calls,
        steps_seen=body.steps.seen,
        steps_captured=body.steps.captured,
        window=(window[0], window[1]) if window is not None else None,
        status=body.status,
        error=body.error,
        command=body.command,
        environment=body.environment,
        settings=body.settings.model_dump(),
    )
