"""Write a file whole or not at all, with the mode the user's umask gives.

Every writer of run files goes through :func:`atomic_write_bytes` (or its text twin, or
:func:`atomic_path` for writers that want a path of their own, such as torch's exporters):

* the data goes to a temporary file in the target's own folder, named uniquely by ``mkstemp``, so two
  processes writing the same target never share (or rename away) each other's temporary file;
* it is flushed and fsync'ed, then renamed over the target with ``os.replace``, which is atomic within
  one file system: a reader, or a run killed half-way, sees the old file or the new one, never a mix;
* ``mkstemp`` creates the file with mode 0600 whatever the umask; the final file gets ``0666 & ~umask``,
  what ``open()`` would have given it, so a group-shared run directory stays readable;
* the temporary file is removed if anything (an exception, a KeyboardInterrupt) stops the write.

Temporary names start with a dot and end in ``.tmp``: hidden, and never taken for a trace by tools that
load every ``*.json``/``*.gz`` of a folder (Holistic Trace Analysis).

Nsight Systems starts the program it profiles with umask 0; :func:`adopt_user_umask` restores the one the
user had, which ``autotuner.main`` passes down in :data:`UMASK_ENV`.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

UMASK_ENV = "AUTOTUNER_UMASK"


def current_umask() -> int:
    """The process's umask. Linux shows it in /proc (reading it leaves it alone); elsewhere it is set and
    set back, which is safe here because no thread of ours creates files at that moment."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def remember_user_umask() -> None:
    """Record this process's umask for the processes it starts (see :func:`adopt_user_umask`)."""
    os.environ[UMASK_ENV] = f"{current_umask():03o}"


def adopt_user_umask() -> None:
    """Take the umask recorded by :func:`remember_user_umask` in a parent, if any (nsys resets it to 0)."""
    recorded = os.environ.get(UMASK_ENV, "")
    try:
        mask = int(recorded, 8)
    except ValueError:
        return
    if 0 <= mask <= 0o777:
        os.umask(mask)


@contextmanager
def atomic_path(final: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a unique temporary path next to ``final`` (the file exists, empty); when the block returns,
    give it the umask's mode and rename it over ``final``. On any exception ``final`` is left as it was."""
    final = Path(final)
    fd, name = tempfile.mkstemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        os.chmod(tmp, 0o666 & ~current_umask())
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically (see the module docstring); returns the path."""
    path = Path(path)
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
    return path


def atomic_write_text(path: str | os.PathLike[str], text: str, encoding: str = "utf-8") -> Path:
    """Write ``text`` to ``path`` atomically (see the module docstring); returns the path."""
    return atomic_write_bytes(path, text.encode(encoding))
