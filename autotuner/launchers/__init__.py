"""Launchers: the same plan of ops, observed three ways.

Each launcher is a module with ``launch(cfg, spec, run) -> int`` (``run``: the RunDirectory it writes
into; the process exit code); this table maps ``launcher.name`` to it, imported only when chosen.
"""

from __future__ import annotations

import importlib
from typing import Any

from omegaconf import DictConfig, OmegaConf

from autotuner.errors import UserError

LAUNCHERS = {
    "get_data": "autotuner.launchers.get_data",
    "nsys": "autotuner.launchers.nsys",
    "torch_profiler": "autotuner.launchers.torch_profiler",
}


def check_settings(cfg: DictConfig, spec: Any) -> None:
    """The chosen launcher's own settings, checked by its module's ``check_settings`` (if it has one)
    before Hydra makes a run directory: a refused run leaves none, and in a sweep no job measures before
    every job's settings passed. Raises UserError."""
    name = OmegaConf.select(cfg, "launcher.name", default=None)
    if name not in LAUNCHERS:  # a launcher YAML of the user's (--config-dir) names its own, or none
        raise UserError(
            f"launcher.name={name} is no launcher: use {', '.join(LAUNCHERS)} (a launcher YAML "
            "of your own starts with defaults: [nsys] and keeps that name)"
        )
    check = getattr(importlib.import_module(LAUNCHERS[cfg.launcher.name]), "check_settings", None)
    if check is not None:
        check(cfg, spec)


def launch(cfg: DictConfig, spec: Any, run: Any) -> int:
    """Run the validated spec with the launcher the config names."""
    return importlib.import_module(LAUNCHERS[cfg.launcher.name]).launch(cfg, spec, run)
