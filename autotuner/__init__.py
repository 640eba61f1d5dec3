"""AutoTuner: an operator-level profiler for Megatron-Core transformers (see README.md and docs/)."""

from __future__ import annotations

from importlib.util import find_spec
from pathlib import Path

from autotuner.megatron_jit import defer_jit_fuser

defer_jit_fuser()  # before anything imports Megatron: see autotuner.megatron_jit


def shipped_folder(name: str) -> Path:
    """The folder of YAML files the package ships: ``"configs"`` (Hydra's) or ``"cases"``.

    The repository keeps them at its top level; setup.py maps them into the package as
    ``autotuner.configs`` and ``autotuner.cases``, so a wheel carries them inside ``autotuner/`` and an
    editable install points those names back at the checkout's folders. A checkout that is only on
    ``sys.path`` (or was installed before the mapping existed) has no such subpackage: its folders lie
    beside the package.
    """
    spec = find_spec(f"{__name__}.{name}")
    if spec is not None and spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations))).resolve()
    return Path(__file__).resolve().parent.parent / name
