"""Print a constraints file: every package of the running environment at its exact version, for this
Python version only. `make lock` runs it in a scratch environment that holds the newest versions
pyproject.toml allows, and writes constraints.txt, which `make setup` installs with."""

from __future__ import annotations

import sys
from importlib.metadata import distributions

from packaging.utils import canonicalize_name

# torch is pinned in the Makefile (TORCH_VERSION), autotuner is this project, and pip and setuptools come
# with the virtual environment rather than from anything the package requires.
LEFT_OUT = {"torch", "autotuner", "pip", "setuptools", "wheel"}


def main() -> None:
    python = f"{sys.version_info.major}.{sys.version_info.minor}"
    pins = {}
    for dist in distributions():
        name = canonicalize_name(dist.metadata["Name"])
        if name not in LEFT_OUT:
            pins[name] = dist.version
    print(f"# Written by `make lock` on Python {python}; `make setup` installs with it (see the Makefile).")
    for name in sorted(pins):
        print(f'{name}=={pins[name]} ; python_version == "{python}"')


if __name__ == "__main__":
    main()
