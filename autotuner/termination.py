"""Ending on SIGTERM as the signal would, once the ``with`` blocks and ``finally`` clauses have run.

SLURM sends SIGTERM at a job's time limit or on preemption, torchrun to its workers when one fails, a user
with ``kill``. Python's default for SIGTERM ends the process on the spot: no ``finally`` runs, so a
temporary directory of measured steps stays behind in /tmp and a lock or a half-written file is not
cleaned up. :func:`unwinding_on_sigterm` turns the signal into :class:`Terminated`, a BaseException (so
that no per-op ``except Exception`` records it as that op's failure), lets the stack unwind through every
cleanup, and then ends the process by the signal itself: whoever started it (SLURM, a shell, torchrun)
still sees it killed by SIGTERM, exit status 143. Two cases end at once instead, as by default: a second
SIGTERM during the unwinding, and a process with other ranks (``WORLD_SIZE`` above 1), whose unwinding
could wait forever in a collective or in the process group's teardown for a rank that is gone.

A handler's raise can be lost. Python runs a signal handler wherever the main thread is, finalizers
included, and an exception raised in a ``__del__`` or a weakref callback is printed ("Exception ignored
in ...") and dropped: the program goes on as if no signal had come, its handler already spent. Finalizers
run at every iteration of some ops (autotuner.ops.instrument frees a hook holder with each embedding
forward's graph), and a stop lost there let an nsys worker measure its whole plan after SIGTERM. So the
handlers raise through :func:`raise_stop`, which remembers the stop, and the loops that measure call
:func:`check_stop` between iterations and between ops, which raises it again if it was lost.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NoReturn

# How often a watch (:func:`stopping_when_gone`) looks, and how long after its SIGTERM it sends SIGKILL.
WATCH_S = 1.0
ORPHAN_GRACE_S = 10.0
# A rank's grace: under WORLD_SIZE > 1 its SIGTERM ends it at once where Python runs; only one held in a
# collective, where no handler runs, waits for the SIGKILL.
RANK_ORPHAN_GRACE_S = 2.0
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def stopping_when_gone(alive: Callable[[], bool], name: str, grace_s: float = ORPHAN_GRACE_S) -> None:
    """A daemon thread that looks each WATCH_S whether ``alive()``; once not, it sends this process
    SIGTERM (its handler unwinds, or ends it at once), then SIGKILL ``grace_s`` later, for a main thread
    held where no Python handler runs (inside a collective whose peer is gone)."""

    def watch() -> None:
        wait = threading.Event().wait
        while alive():
            wait(WATCH_S)
        os.kill(os.getpid(), signal.SIGTERM)
        wait(grace_s)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name=name, daemon=True).start()


_WATCHING_PARENT: list[int] = []


def stopping_with_torchrun() -> None:
    """Under torchrun, end this rank when torchrun is gone. Its agent is the ranks' parent and passes on a
    SIGTERM, but killed outright (``kill -9``, the OOM killer) it passes nothing, and the ranks, orphaned,
    ran the plan to its end. Linux's parent-death signal (``prctl(PR_SET_PDEATHSIG, SIGTERM)``, kept by
    the kernel) sends SIGTERM at once, and a watch of the parent's pid (:func:`stopping_when_gone`) backs
    it up where prctl is missing, and sends SIGKILL to a rank held in a collective. What the rank wrote
    is whole (atomic writes) and ``resume=true`` finishes the run. Only where the parent is torchrun
    (``torch.distributed.run``): a death signal is the parent thread's, and torchrun's agent starts its
    ranks from its main thread. Once per process."""
    parent = os.getppid()
    if _WATCHING_PARENT or "TORCHELASTIC_RUN_ID" not in os.environ or not _is_torchrun(parent):
        return
    _WATCHING_PARENT.append(parent)
    with contextlib.suppress(OSError, AttributeError):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    stopping_when_gone(lambda: os.getppid() == parent, "torchrun-watch", RANK_ORPHAN_GRACE_S)
    if os.getppid() != parent:  # gone before the death signal was set: no signal will come for it
        os.kill(os.getpid(), signal.SIGTERM)


def _is_torchrun(pid: int) -> bool:
    """Whether process ``pid`` runs torchrun (``torchrun``, or ``python -m torch.distributed.run``)."""
    try:
        args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return b"torch.distributed.run" in args or any(
        Path(a.decode(errors="replace")).name == "torchrun" for a in args
    )


class Terminated(BaseException):
    """Raised by :func:`unwinding_on_sigterm`'s handler; caught by it once the stack has unwound."""


_raised_stop: Callable[[], BaseException] | None = None  # see raise_stop


def raise_stop(stop: Callable[[], BaseException]) -> NoReturn:
    """Raise ``stop()`` from a signal handler, remembered for :func:`check_stop` (module docstring)."""
    global _raised_stop
    _raised_stop = stop
    raise stop()


def check_stop() -> None:
    """Raise again the stop a handler raised, if it has not been caught (:func:`forget_stop`) since: a
    finalizer swallowed it. Call it where the program does its work, never in cleanup."""
    if _raised_stop is not None:
        raise _raised_stop()


def forget_stop() -> None:
    """The stop was caught where it was meant to be: :func:`check_stop` has nothing to raise again."""
    global _raised_stop
    _raised_stop = None


def _end_by_sigterm() -> None:
    """End this process by SIGTERM's default action (the status a parent reads: killed by signal 15)."""
    sys.stdout.flush()
    sys.stderr.flush()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


def ending_in_one_line_on_ctrl_c(prog: str) -> Callable[[Callable[..., int]], Callable[..., int]]:
    """For a command's ``main`` (returning its exit status): Ctrl-C ends it with ``<prog>: interrupted``
    on stderr and exit status 130 (the shell's for SIGINT), not a traceback, also where a finalizer
    swallowed the KeyboardInterrupt and ``main`` went on to return (:func:`interrupting_on_sigint`). What
    the commands write is written atomically, so nothing half-written is left to mention."""

    def decorate(main: Callable[..., int]) -> Callable[..., int]:
        @functools.wraps(main)
        def guarded(*args: Any, **kwargs: Any) -> int:
            try:
                with interrupting_on_sigint():
                    status = main(*args, **kwargs)
                    check_stop()
                return status
            except KeyboardInterrupt:
                forget_stop()
                print(f"{prog}: interrupted", file=sys.stderr)
                return 130

        return guarded

    return decorate


def ending_quietly_on_a_closed_pipe(main: Callable[..., Any]) -> Callable[..., Any]:
    """For a command's ``main``: a reader that stops reading (``| head``, quitting ``less``) ends the
    command as SIGPIPE ends a C tool, with the shell's status for it (141) and no traceback. Python ignores
    SIGPIPE and raises BrokenPipeError at the next write instead; stdout is pointed at /dev/null first, or
    the interpreter's own flush at exit raises again. The files a command writes are written atomically,
    so a stop here leaves them whole."""

    @functools.wraps(main)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        try:
            status = main(*args, **kwargs)
            sys.stdout.flush()  # here, not at the interpreter's exit, where a closed pipe is a stray message
            return status
        except BrokenPipeError:
            end_on_a_closed_pipe()

    return guarded


def end_on_a_closed_pipe(at_once: bool = False) -> NoReturn:
    """End as :func:`ending_quietly_on_a_closed_pipe` ends a command, from where a BrokenPipeError was
    caught (a handler that would report it as another failure). ``at_once``: without the interpreter's
    exit, as a rank of a process group leaves (a normal exit can block in the group's teardown)."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    if at_once:
        sys.stderr.flush()
        os._exit(128 + signal.SIGPIPE)
    raise SystemExit(128 + signal.SIGPIPE)


@contextlib.contextmanager
def interrupting_on_sigint(on_signal: Callable[[], None] | None = None) -> Iterator[None]:
    """Inside, Ctrl-C (SIGINT) raises KeyboardInterrupt as Python's own handler does, but through
    :func:`raise_stop`: one raised in a finalizer and dropped is raised again by :func:`check_stop`
    (module docstring), so a run does not go on measuring after Ctrl-C. ``on_signal`` runs first, in the
    handler (where the run's state is still set up). The caller catches the KeyboardInterrupt (and calls
    :func:`forget_stop`). Outside the main thread it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_sigint(signum: int, frame: Any) -> None:
        if on_signal is not None:
            on_signal()
        raise_stop(KeyboardInterrupt)

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous if previous is not None else signal.SIG_DFL)


@contextlib.contextmanager
def unwinding_on_sigterm(on_signal: Callable[[], bool] | None = None) -> Iterator[None]:
    """Inside, a SIGTERM raises :class:`Terminated` where the main thread is, and on leaving the process
    ends as the signal would (module docstring). ``on_signal`` runs first, in the handler, and says
    whether to unwind (False: end at once). Nested in another (a benchmark running a profile in its own
    process), it passes Terminated on, so that the outer one's cleanups run too. Outside the main thread
    (where no handler may be set) it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGTERM)
    enclosed = getattr(previous, "unwinds", False)

    def on_sigterm(signum: int, frame: Any) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM ends the process at once
        unwind = on_signal() if on_signal is not None else True
        if not unwind or int(os.environ.get("WORLD_SIZE", 1)) > 1:
            _end_by_sigterm()
        raise_stop(Terminated)

    on_sigterm.unwinds = True  # type: ignore[attr-defined]
    signal.signal(signal.SIGTERM, on_sigterm)
    terminated = False
    try:
        yield
    except Terminated:
        terminated = True
        if enclosed:
            raise
        forget_stop()
        _end_by_sigterm()
        raise SystemExit(128 + signal.SIGTERM) from None  # not reached: the signal ends the process
    finally:
        if not terminated:  # else SIG_DFL stays: a second SIGTERM while unwinding ends the process
            signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)


def ending_as_a_command(prog: str) -> Callable[[Callable[..., int]], Callable[..., int]]:
    """For a long-running command's ``main``: a reader that stops reading, Ctrl-C and SIGTERM each end it
    as the three decorators above do (a closed pipe quietly, Ctrl-C in one line, SIGTERM after the
    temporary folders of steps and profiles are removed)."""

    def decorate(main: Callable[..., int]) -> Callable[..., int]:
        return ending_quietly_on_a_closed_pipe(
            ending_in_one_line_on_ctrl_c(prog)(unwinding_on_sigterm()(main))
        )

    return decorate
