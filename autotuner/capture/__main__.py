"""``autotuner-capture out=shapes.json [steps=1:3] -- python train.py ARGS...``

Runs the training command in a child process that captures it (autotuner.capture._child) and then:
* the child's stdout and stderr are the terminal's own (inherited, never piped or rewritten);
* its exit code is ours; killed by a signal, we end by the same signal (``$?`` shows 128+N as for the
  plain command);
* one line on stderr at the end says what was captured, or that nothing was (a file left there by an
  earlier capture is not taken for this one's).

Bad input is one line on stderr before anything runs: an ``out`` that is a folder or cannot be made, a
command that is not a Python script, and a script that cannot be opened (exit code 2, as Python gives).

The parent never imports torch. SIGTERM sent to it is passed on to the child (which writes its capture and
ends); SIGINT is ignored here because a terminal's Ctrl-C reaches the child directly, and passing it on
too would interrupt the child's writing of the file.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from autotuner.capture import _child
from autotuner.cli import Command, entry, parse, setting
from autotuner.errors import UserError, say_error
from autotuner.results.atomic import check_writable
from autotuner.termination import ending_quietly_on_a_closed_pipe

USAGE = "autotuner-capture out=FILE [steps=START:STOP] -- python SCRIPT.py ARGS..."
# Interpreter options that take no value, allowed between "python" and the script.
_PYTHON_FLAGS = {"-u", "-O", "-OO", "-B", "-s", "-E", "-I", "-q", "-b", "-bb"}


def child_command(command: list[str], options: list[str]) -> list[str]:
    """The child's argument list for ``command`` (``python [flags] SCRIPT|-m MODULE ARGS`` or ``SCRIPT.py
    ARGS``): the same interpreter, our bootstrap module, then the script and its arguments."""
    if not command:
        raise UserError(f"no command to capture: {USAGE}")
    if command[0].endswith(".py"):
        python, rest = sys.executable, command
    elif Path(command[0]).name.startswith("python"):
        # A bare "python" means this Python (the one that has autotuner); a path is taken as given.
        python = command[0] if "/" in command[0] else sys.executable
        rest = command[1:]
    else:
        raise UserError(
            f"the command must be a Python script, got {command[0]!r}: {USAGE} "
            "(for torchrun, capture inside the script with autotuner.capture.capture)"
        )
    flags = []
    while rest and rest[0] in _PYTHON_FLAGS:
        flags.append(rest.pop(0))
    if not rest or rest[0].startswith("-") and rest[0] != "-m":
        raise UserError(f"give a script or -m MODULE after the interpreter: {USAGE}")
    return [python, *flags, "-m", "autotuner.capture._child", *options, "--", *rest]


def _signature(path: Path) -> tuple[int, int, int] | None:
    """What tells this file apart from the one written after it (the capture replaces it by a rename)."""
    try:
        stat = path.stat()
    except OSError:
        return None
    return stat.st_ino, stat.st_mtime_ns, stat.st_size


def _summary(out: Path, returncode: int, before: tuple[int, int, int] | None) -> str:
    from autotuner.capture.schema import load

    ending = f"exit code {returncode}" if returncode >= 0 else f"killed by {signal.Signals(-returncode).name}"
    after = _signature(out)
    if after is None or after == before:
        earlier = "; the file there is from an earlier capture" if after is not None else ""
        return f"autotuner.capture: nothing written to {out} ({ending}){earlier}"
    try:
        capture = load(out)
    except UserError as exc:
        return f"autotuner.capture: {exc}"
    status = capture.status + (f": {capture.error}" if capture.error else "")
    compiled = capture.settings.get("torch_compile")
    return (
        f"autotuner.capture: {capture.total_calls} calls, {len(capture.calls)} distinct, in "
        f"{capture.steps_captured} optimizer step(s) -> {out} ({status}, {ending})"
        + (f"; note: the torch.compile'd model {compiled}" if compiled else "")
    )


@dataclass(frozen=True)
class CaptureSettings:
    out: str | None = setting(None, "the capture file to write (JSON); required", "FILE")
    steps: str | None = setting(
        None, "the optimizer steps to capture, START:STOP (default every step)", "START:STOP"
    )
    functions: list[str] | None = setting(
        None, "torch.nn.functional names to capture (default the capture's own list)", "[NAME,...]"
    )
    methods: list[str] | None = setting(
        None, "Tensor methods to capture (default the capture's own list)", "[NAME,...]"
    )


COMMAND = Command(
    "autotuner-capture",
    "autotuner.capture",
    "Record the module calls (and their shapes) a training command makes, to profile them with "
    "autotuner capture=FILE. The training command follows --.",
    "",
    CaptureSettings,
    least=0,
    most=0,
    trailing="python SCRIPT.py ARGS...",
    epilog="example: autotuner-capture out=shapes.json steps=1:3 -- python train.py --lr 3e-4",
)


@entry(COMMAND)
def run(argv: list[str]) -> int:
    """Run the capture CLI; return the exit code (negative: the child was killed by that signal)."""
    _, args, command = parse(COMMAND, argv)
    try:
        if args.out is None:
            raise UserError("give out=FILE, the capture file to write")
        steps = _child.parse_steps(args.steps)
    except (UserError, ValueError) as exc:
        say_error(COMMAND.name, exc)
        return 2
    out = Path(args.out).resolve()
    options = ["--out", str(out)]
    if steps:
        options += ["--steps", f"{steps[0]}:{steps[1]}"]
    for name in ("functions", "methods"):
        if getattr(args, name) is not None:
            options.append(f"--{name}={','.join(getattr(args, name))}")
    try:
        check_writable(out, f"out={out}")  # before the training runs: its end writes the file
        argv_child = child_command(list(command), options)
        script = argv_child[argv_child.index("--") + 1]
        # Only a script is checked here: a module is looked up by the child's interpreter, on its path.
        reason = None if script == "-m" else _child.cannot_open(script)
        if reason:
            raise UserError(f"{reason}: give the path of the training script")
    except UserError as exc:
        say_error(COMMAND.name, exc)
        return exc.exit_code  # Python's own code for a script it cannot open, too
    before = _signature(out)
    child = subprocess.Popen(argv_child)  # before ignoring SIGINT: the child must not inherit SIG_IGN
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda signum, frame: child.send_signal(signum))
    try:
        returncode = child.wait()
    finally:
        signal.signal(signal.SIGINT, previous)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    print(_summary(out, returncode, before), file=sys.stderr)
    return returncode


@ending_quietly_on_a_closed_pipe
def main() -> None:
    code = run(sys.argv[1:])
    if code < 0:  # end as the child did, by its signal (default action: Python's own SIGINT handler
        sys.stdout.flush()  # would raise KeyboardInterrupt here instead)
        sys.stderr.flush()
        if -code not in (signal.SIGKILL, signal.SIGSTOP):  # these two cannot be handled, nor reset
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    raise SystemExit(code if code >= 0 else 128 - code)


if __name__ == "__main__":
    main()
