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
load every ``*.json``/``*.gz`` of a folder (Holistic Trace Analysis). Missing folders above the target
are made.

A command that measures first and writes at its end checks its targets with :func:`check_writable`
before it measures: an output path that names a folder, or lies under a file, would otherwise lose what
was measured to the last step's OSError.

Nsight Systems starts the program it profiles with umask 0; :func:`adopt_user_umask` restores the one the
user had, which ``autotuner.main`` passes down in :data:`UMASK_ENV`.
"""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from autotuner.errors import UserError

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


# The files in which a run folder keeps what it measured (autotuner.results, autotuner.calibrate), and its
# report.
RUN_RECORDS = re.compile(r"results(\.rank\d+)?\.(jsonl|csv)|environment\.json|calibration\.json|report\.html")


def check_writable(
    path: str | os.PathLike[str],
    named: str,
    folder: bool = False,
    reads: Iterable[str | os.PathLike[str]] = (),
) -> None:
    """Refuse, before any work, a target the writer could not make when the work ends: a file's path that
    is a folder, a folder's that is a file, or one whose nearest existing folder above is a file or not
    writable (the folders between are made); and a file that is one of the records of a run folder the
    command ``reads``: writing it would replace what was measured. ``named`` is how the user gave it
    (``out=x.json``, ``hydra.run.dir=x``), which the one-line UserError repeats."""
    target = Path(os.path.abspath(path))
    if not folder and RUN_RECORDS.fullmatch(target.name):
        for run_dir in reads:
            if target.parent.resolve() == Path(run_dir).resolve():
                raise UserError(
                    f"{named} is the run's own {target.name} in {run_dir}: writing it would replace what "
                    "was measured; give another file name"
                )
    try:
        _check_reachable(target, named, folder)
        if folder and target.exists() and not target.is_dir():
            raise UserError(f"{named} is a file, not a folder: give a folder")
        if not folder and target.is_dir():
            raise UserError(f"{named} is a folder: give a file name in it, e.g. {target / 'out.json'}")
        existing = target if folder else target.parent
        while not existing.exists():
            existing = existing.parent
        if not existing.is_dir():
            raise UserError(f"{named}: {existing} is a file, not a folder: give a path under a folder")
        _probe(existing, named)
    except OSError as exc:  # a name too long, a loop of links: what the OS said
        raise UserError(f"{named} cannot be used ({exc.strerror or exc}): give another path") from exc


# The characters mkstemp adds to a file's name for its temporary (".", ".", 8 random, ".tmp").
_TEMPORARY_EXTRA = 14


def _check_reachable(target: Path, named: str, folder: bool) -> None:
    """Refuse a path the writer could not open: a loop of links on it (pathlib's exists() says False to
    one, and the run ended in a traceback), a name longer than the file system's NAME_MAX, or a path too
    long for what goes in it: a folder must leave room for a file name of NAME_MAX (a run's files, their
    temporaries, a profiler's folders), a file for its temporary beside it. A run directory near PATH_MAX
    had made its folders and a lock file, then failed at its first results file."""
    try:
        os.stat(target)
    except (FileNotFoundError, NotADirectoryError):
        pass  # made later, or refused below (a file among the folders above)
    existing = target
    while not os.path.lexists(existing) and existing != existing.parent:
        existing = existing.parent
    name_max = os.pathconf(existing, "PC_NAME_MAX") if existing.is_dir() else 255
    path_max = os.pathconf(existing, "PC_PATH_MAX") if existing.is_dir() else 4096
    longest = [(part, name_max) for part in target.parts[:-1]]
    longest.append((target.name, name_max if folder else name_max - _TEMPORARY_EXTRA))
    long_name = next(((part, most) for part, most in longest if len(os.fsencode(part)) > most), None)
    if long_name is not None:
        raise UserError(
            f"{named}: the name {long_name[0][:20]}... is {len(os.fsencode(long_name[0]))} characters, above "
            f"the {long_name[1]} this file system allows there: give a path of shorter names"
        )
    inside = name_max + 1 if folder else _TEMPORARY_EXTRA
    if len(os.fsencode(target)) + inside >= path_max:
        raise UserError(
            f"{named} is {len(os.fsencode(target))} characters long, too long for the "
            f"{'files a run writes in it' if folder else 'temporary file written beside it'} (paths on "
            f"this file system end at {path_max - 1}): give a shorter path"
        )


def _probe(folder: Path, named: str) -> None:
    """Make (and remove) a file in ``folder`` as the writer will: ``os.access`` says yes to root for any
    folder, /proc's included, and the work was lost when its results could not be written."""
    try:
        fd, name = tempfile.mkstemp(prefix=".autotuner-probe-", dir=folder)
    except OSError as exc:
        raise UserError(
            f"{named}: cannot write in {folder} ({exc.strerror or exc}): "
            "give a path in a folder you can write"
        ) from None
    os.close(fd)
    os.unlink(name)


@contextmanager
def atomic_path(final: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a unique temporary path next to ``final`` (the file exists, empty); when the block returns,
    give it the umask's mode and rename it over ``final``. On any exception ``final`` is left as it was."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
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
