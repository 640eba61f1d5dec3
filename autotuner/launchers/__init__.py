"""Launchers: the same plan of ops, observed three ways.

Each launcher is a module with ``launch(cfg, spec, run_dir) -> int`` (the process exit code); this table
maps ``launcher.name`` to it, imported only when chosen.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

LAUNCHERS = {
    "get_data": "autotuner.launchers.get_data",
    "nsys": "autotuner.launchers.nsys",
    "torch_profiler": "autotuner.launchers.torch_profiler",
}


def launch(cfg: DictConfig, spec: Any, run_dir: Path) -> int:
    """Run the validated spec with the launcher the config names."""
    return importlib.import_module(LAUNCHERS[cfg.launcher.name]).launch(cfg, spec, run_dir)
