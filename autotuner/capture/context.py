"""The ``capture`` context manager: install a Recorder around a block and write its file at the end."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

from autotuner.capture.recorder import DEFAULT_FUNCTIONS, DEFAULT_METHODS, Recorder


def ending(exc: BaseException | None) -> tuple[str, str | None]:
    """(status, one-line error) for how the captured code ended."""
    if exc is None:
        return "complete", None
    if isinstance(exc, SystemExit):
        code = exc.code
        return ("complete", None) if code in (None, 0) else ("exit", f"SystemExit: {code}")
    status = "interrupted" if isinstance(exc, KeyboardInterrupt) else "exception"
    text = str(exc).strip().splitlines()
    return status, f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


@contextlib.contextmanager
def capture(
    out: str | Path | None = None,
    steps: tuple[int, int] | None = None,
    functions: Sequence[str] = DEFAULT_FUNCTIONS,
    methods: Sequence[str] = DEFAULT_METHODS,
) -> Iterator[Recorder]:
    """Record calls inside the ``with`` block; write the capture to ``out`` when it ends.

    ``steps=(start, stop)`` keeps calls made after ``start`` optimizer steps and before ``stop`` (``(1, 3)``
    skips the first step, whose one-off work is not training, and records the next two); None keeps all.
    The file is written however the block ends (an exception or ``sys.exit`` too, with the status saying
    so), and the exception goes on. ``{rank}`` in ``out`` becomes the process's ``RANK`` (0 without one).
    """
    # Resolved now, before the code under capture can chdir; {rank} keeps torchrun's ranks apart.
    target = (
        Path(str(out).replace("{rank}", os.environ.get("RANK", "0"))).resolve() if out is not None else None
    )
    recorder = Recorder(steps, functions, methods)
    recorder.install()
    failure: BaseException | None = None
    try:
        yield recorder
    except BaseException as exc:
        failure = exc
        raise
    finally:
        recorder.uninstall()
        if target is not None:
            status, error = ending(failure)
            try:
                recorder.write(target, status, error)
            except Exception as exc:  # noqa: BLE001 - never hide the program's own failure behind ours
                if failure is None:
                    raise
                print(f"autotuner.capture: could not write {target}: {exc}", file=sys.stderr)
