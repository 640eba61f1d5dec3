"""What the capture command and the captured process both read of the command line: the window of
optimizer steps and whether the script can be opened. The command checks them before starting the
child, so bad input is one line before anything runs; the child reads them again from its arguments.
"""

from __future__ import annotations

import os


def parse_steps(text: str | None) -> tuple[int, int] | None:
    """``START:STOP`` (optimizer steps; ``:STOP`` starts at 0) or None."""
    if not text:
        return None
    start, sep, stop = text.partition(":")
    try:
        window = (int(start or 0), int(stop)) if sep else None
    except ValueError:
        window = None
    if window is None or not 0 <= window[0] < window[1]:
        raise ValueError(f"steps wants START:STOP with 0 <= START < STOP, got {text!r}")
    return window


def cannot_open(script: str) -> str | None:
    """Why Python could not open ``script`` (one line, Python's words), or None. A folder runs its
    ``__main__.py``, as Python runs it (runpy, in the capture); one without is refused here."""
    if os.path.isdir(script):
        has_main = os.path.isfile(os.path.join(script, "__main__.py"))
        return None if has_main else f"can't find '__main__' module in {script!r}"
    try:
        with open(script, "rb"):
            return None
    except OSError as exc:
        return f"can't open file {script!r}: {exc.strerror or exc}"
