"""The captured process: start capturing, run the user's script as ``__main__``, write what was captured.

``python -m autotuner.capture._child --out FILE [options] -- (SCRIPT | -m MODULE) ARGS...`` is what
``python -m autotuner.capture`` runs. The script sees the ``sys.argv`` and ``sys.path[0]`` that
``python SCRIPT ARGS...`` would give it (``runpy`` runs it as ``__main__``). The capture file is written when
the script returns, raises (the exception then goes on: Python prints its traceback and exits 1),
calls ``sys.exit`` (its code passes through) or receives SIGTERM (after writing, the process ends by the
same signal, so the parent sees what a plain run would show). A script that installs its own SIGTERM
handler replaces ours; the file is then written when it exits.

A program that never starts writes nothing: a script that cannot be opened, does not compile, or a
module that cannot be found is refused before capturing begins, as Python itself refuses it (the same
message on stderr and exit code: 2 for a script that cannot be opened, 1 otherwise). Once the program
has started, its capture is written however it ends: calls recorded before an exception are real calls,
and the file's ``status`` and ``error`` say that the run failed, so it never passes for a complete one.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import runpy
import signal
import sys
import traceback
from pathlib import Path
from typing import Any


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


def names(text: str) -> list[str]:
    return [n.strip() for n in text.split(",") if n.strip()]


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


def unstartable(target: list[str]) -> tuple[str, int] | None:
    """(what to print, Python's exit code) when ``python TARGET`` would not start, else None.

    Nothing is imported: importing the user's package now, before the recorder replaces torch's functions,
    would let it keep the originals. So a module is looked up by its top-level name only; a missing
    submodule is found by runpy, inside the capture, as an ordinary exception.
    """
    if target[0] == "-m":
        top = target[1].partition(".")[0]
        try:
            found = importlib.util.find_spec(top) is not None
        except (ImportError, ValueError):
            found = False
        return None if found else (f"autotuner.capture: error: No module named {top!r}", 1)
    script = target[0]
    reason = cannot_open(script)
    if reason:
        return f"autotuner.capture: error: {reason}: give the path of the training script", 2
    if os.path.isdir(script):
        return None
    try:
        compile(Path(script).read_bytes(), script, "exec")
    except (SyntaxError, ValueError) as exc:  # the user's own error, shown as Python shows it
        return "".join(traceback.format_exception_only(exc)).rstrip("\n"), 1
    return None


def _on_sigterm(recorder: Any, out: Path) -> Any:
    def handler(signum: int, frame: Any) -> None:
        signal.signal(signum, signal.SIG_IGN)  # a second SIGTERM must not cut the write short
        recorder.uninstall()
        try:
            recorder.write(out, "signal", f"terminated by {signal.Signals(signum).name}")
        finally:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    return handler


def main(argv: list[str]) -> None:
    from autotuner.capture.context import capture
    from autotuner.capture.recorder import DEFAULT_FUNCTIONS, DEFAULT_METHODS, resolve_targets

    parser = argparse.ArgumentParser(prog="python -m autotuner.capture._child")
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=parse_steps, default=None)
    parser.add_argument("--functions", type=names, default=list(DEFAULT_FUNCTIONS))
    parser.add_argument("--methods", type=names, default=list(DEFAULT_METHODS))
    parser.add_argument("target", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    target = args.target[1:] if args.target[:1] == ["--"] else args.target
    if not target or target[:1] == ["-m"] and len(target) < 2:
        parser.error("give the script to run: -- SCRIPT ARGS... or -- -m MODULE ARGS...")
    try:
        resolve_targets(args.functions, args.methods)
    except ValueError as exc:
        print(f"autotuner.capture: error: {exc}: fix --functions/--methods", file=sys.stderr)
        raise SystemExit(2) from None
    refused = unstartable(target)
    if refused:
        print(refused[0], file=sys.stderr)
        raise SystemExit(refused[1])
    out = Path(args.out).resolve()
    with capture(out, args.steps, args.functions, args.methods) as recorder:
        signal.signal(signal.SIGTERM, _on_sigterm(recorder, out))
        if target[0] == "-m":
            sys.argv = [target[1], *target[2:]]  # run_module puts the module's file in argv[0]
            runpy.run_module(target[1], run_name="__main__", alter_sys=True)
        else:
            script = target[0]
            sys.argv = list(target)
            sys.path[0] = str(Path(script).resolve().parent)
            runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
