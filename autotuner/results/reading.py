"""Reading a file of a run directory: a regular file of a sane size, or one line saying what it is.

A run directory is input like any other, and a name in it may be something a plain ``open()`` trusts
too much: a FIFO (the open waits for a writer that never comes: resume, predict, compare and report
hung), a device (``/dev/zero`` never ends), a folder, a socket, a loop of links, or a sparse file of
terabytes. Every file the tools read from a run directory comes through :func:`read_run_bytes` (or its
text twin): it looks at what the name is before opening it, opens without blocking, checks the opened
file again (the name may be swapped in between) and reads at most its limit, else
:class:`UnreadableRunFile`, a UserError: one line, exit 2.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from autotuner.errors import UserError

# No file a run writes comes near this (a results row is about 2 KiB; a plan has thousands of rows).
MAX_RUN_FILE_BYTES = 1 << 30

_KINDS = (
    (stat.S_ISDIR, "a folder"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)
_FIX = "replace it with the file the run wrote, or move it away"


class UnreadableRunFile(UserError):
    """A file of a run directory that is not a regular file, is too large, or cannot be read."""


def kind_of(mode: int) -> str:
    """What a file of this ``st_mode`` is, in words ("a FIFO"); "a regular file" for one."""
    if stat.S_ISREG(mode):
        return "a regular file"
    return next((words for test, words in _KINDS if test(mode)), "not a regular file")


def check_regular(path: str | os.PathLike[str], fix: str = _FIX) -> None:
    """Raise :class:`UnreadableRunFile` unless ``path`` is absent or a regular file (links followed):
    for a file a run writes in place (Hydra's log and config), where a FIFO would hold the open."""
    path = Path(path)
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        if os.path.lexists(path):  # a link to nothing: writing would make its target
            raise UnreadableRunFile(f"{path} is a link to nothing: {fix}") from None
        return
    except OSError as exc:
        raise UnreadableRunFile(f"cannot read {path} ({exc.strerror or exc}): {fix}") from None
    if not stat.S_ISREG(mode):
        raise UnreadableRunFile(f"{path} is {kind_of(mode)}, not a regular file: {fix}")


def read_run_bytes(path: str | os.PathLike[str], limit: int = MAX_RUN_FILE_BYTES, fix: str = _FIX) -> bytes:
    """The bytes of ``path``, a regular file of at most ``limit`` bytes; :class:`UnreadableRunFile`
    (naming the file, what it is and ``fix``) for anything else, a missing file included."""
    path = Path(path)
    try:
        check_regular(path, fix)
        if not path.exists():
            raise FileNotFoundError(2, "No such file or directory")
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | getattr(os, "O_CLOEXEC", 0))
        try:
            opened = os.fstat(fd)
            if not stat.S_ISREG(opened.st_mode):  # swapped for something else since the check
                raise UnreadableRunFile(f"{path} is {kind_of(opened.st_mode)}, not a regular file: {fix}")
            if opened.st_size > limit:
                raise UnreadableRunFile(
                    f"{path} is {opened.st_size} bytes, more than a run writes ({limit}): {fix}"
                )
            chunks, left = [], limit + 1
            while left > 0:
                chunk = os.read(fd, min(left, 1 << 20))
                if not chunk:
                    break
                chunks.append(chunk)
                left -= len(chunk)
        finally:
            os.close(fd)
    except OSError as exc:
        raise UnreadableRunFile(f"cannot read {path} ({exc.strerror or exc}): {fix}") from None
    data = b"".join(chunks)
    if len(data) > limit:  # grew while read
        raise UnreadableRunFile(f"{path} is more than {limit} bytes, more than a run writes: {fix}")
    return data


def read_run_text(path: str | os.PathLike[str], limit: int = MAX_RUN_FILE_BYTES, fix: str = _FIX) -> str:
    """:func:`read_run_bytes` decoded as UTF-8; :class:`UnreadableRunFile` for text that is not."""
    data = read_run_bytes(path, limit, fix)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UnreadableRunFile(f"{path} is not UTF-8 text (byte {exc.start}): {fix}") from None
