"""Real file-system faults without root: a command run in a user and mount namespace of its own
(``unshare --user --map-root-user --mount``), where it may mount a tmpfs of a given size (a disk that
fills: ENOSPC) or bind a folder read-only (EROFS, which root's permissions do not override). The mounts
end with the namespace; the folders outside are as they were.

``python tests/namespaces.py [--tmpfs DIR SIZE]... [--read-only DIR]... -- COMMAND...`` is the part that
runs inside: it mounts, then execs COMMAND.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

HERE = Path(__file__).resolve()


@functools.cache
def unavailable() -> str | None:
    """Why no namespace can be made here (no unshare, or unprivileged user namespaces refused), else None."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return "no unshare (util-linux) on this machine"
    probe = subprocess.run(
        [unshare, "--user", "--map-root-user", "--mount", "--", "mount", "-t", "tmpfs", "-o", "size=64k",
         "tmpfs", "/mnt"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    if probe.returncode != 0:
        return f"no user and mount namespace here: {probe.stderr.strip() or probe.returncode}"
    return None


def namespaced(
    command: Sequence[str | os.PathLike[str]],
    tmpfs: Sequence[tuple[Path, str]] = (),
    read_only: Sequence[Path] = (),
) -> list[str]:
    """The argument list that runs ``command`` with ``tmpfs`` (folder, size such as ``1m``) mounted and
    ``read_only`` folders bound read-only; the test is skipped, saying why, where no namespace can be made."""
    reason = unavailable()
    if reason is not None:
        pytest.skip(reason)
    mounts = [arg for folder, size in tmpfs for arg in ("--tmpfs", str(folder), size)]
    mounts += [arg for folder in read_only for arg in ("--read-only", str(folder))]
    unshare = ["unshare", "--user", "--map-root-user", "--mount", "--"]
    return [*unshare, sys.executable, str(HERE), *mounts, "--", *map(str, command)]


def _mount_and_exec(argv: list[str]) -> None:
    split = argv.index("--")
    options, command = argv[:split], argv[split + 1 :]
    while options:
        if options[0] == "--tmpfs":
            folder, size = options[1], options[2]
            subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", folder], check=True)
            options = options[3:]
        elif options[0] == "--read-only":
            folder = options[1]
            subprocess.run(["mount", "--bind", folder, folder], check=True)
            subprocess.run(["mount", "-o", "remount,ro,bind", folder], check=True)
            options = options[2:]
        else:
            raise SystemExit(f"namespaces.py: unknown option {options[0]}")
    os.execvp(command[0], command)


if __name__ == "__main__":
    _mount_and_exec(sys.argv[1:])
