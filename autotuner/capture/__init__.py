"""Capture the shapes a real training run uses, and profile exactly those.

* ``autotuner-capture out=shapes.json -- python train.py ARGS...`` runs the script and records
  every module call and a configured set of ``torch.nn.functional`` functions and ``Tensor`` methods
  (autotuner.capture.recorder); or, inside a script::

      from autotuner.capture import capture
      with capture(out="shapes.json", steps=(1, 3)):
          train()

* ``python -m autotuner.main capture=shapes.json`` profiles what was captured: Megatron-Core layers at
  their captured shape points (autotuner.capture.megatron), anything else as one benchmark per distinct
  call (autotuner.capture.generic). autotuner.capture.schema documents the file.

Importing this package does not import torch (the command-line parent never needs it).
"""

from __future__ import annotations

from typing import Any

__all__ = ["capture", "load", "Recorder"]


def __getattr__(name: str) -> Any:
    if name == "capture":
        from autotuner.capture.context import capture

        return capture
    if name == "Recorder":
        from autotuner.capture.recorder import Recorder

        return Recorder
    if name == "load":
        from autotuner.capture.schema import load

        return load
    raise AttributeError(name)
