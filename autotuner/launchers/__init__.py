"""Launchers: the same plan of ops, observed three ways. ``LAUNCHERS`` maps ``launcher.name`` to the
function that runs a validated spec in a run directory and returns the process exit code."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from omegaconf import DictConfig


def _get_data(cfg: DictConfig, spec: Any, run_dir: Path) -> int:
    from autotuner.launchers.get_data import launch

    return launch(cfg, spec, run_dir)


LAUNCHERS: dict[str, Callable[[DictConfig, Any, Path], int]] = {"get_data": _get_data}
