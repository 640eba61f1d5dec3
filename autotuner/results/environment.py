"""A run's ``environment.json``, read back by the tools (compare, report, predict, tune): one reader, which
checks what they rely on, so that a damaged record is one line naming the field rather than a traceback
deep inside one of them.

The launchers write it (autotuner.launchers.common.start_writer); its sections are JSON objects, and the
model's sizes in ``transformer_config`` and ``model_args`` whole numbers above zero, which the predictor
multiplies (a ``num_layers`` of -2 gave a negative step time). A run may lack the file (compare, report and
predict then say less, or take the sizes from the case its rows name).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from autotuner.errors import UserError
from autotuner.results.reading import read_run_text

FILE_NAME = "environment.json"
SECTIONS = ("environment", "environments", "transformer_config", "model_args", "fingerprint", "routing")
# Sizes the tools compute with, checked when present and not null; with a transformer_config, those of
# _REQUIRED must be there (the predictor builds the model's shape from them).
_SIZES = {
    "transformer_config": (
        "num_layers",
        "hidden_size",
        "ffn_hidden_size",
        "num_attention_heads",
        "num_query_groups",
        "kv_channels",
        "num_moe_experts",
        "moe_ffn_hidden_size",
        "moe_router_topk",
        "expert_model_parallel_size",
        "tensor_model_parallel_size",
    ),
    "model_args": ("vocab_size", "max_sequence_length"),
}
_REQUIRED = {
    "transformer_config": ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads"),
    "model_args": ("vocab_size",),
}
MAX_LAYERS = 10_000
_FIX = "restore it from the run, or measure the run again"


def load_environment(run_dir: str | Path) -> dict[str, Any]:
    """The run's record, checked; ``{}`` where the run has none. Raises UserError (one line)."""
    path = Path(run_dir) / FILE_NAME
    if not os.path.lexists(path):
        return {}
    text = read_run_text(path, fix=_FIX)  # a FIFO or a device: one line, never an open that waits
    try:
        record = json.loads(text)
    except ValueError:
        record = None
    if not isinstance(record, dict):
        raise UserError(f"{path} is not a JSON object: {_FIX}")
    for section in SECTIONS:
        if section in record and not isinstance(record[section], dict):
            raise UserError(f"{path}: {section} is {json.dumps(record[section])[:40]}, not an object: {_FIX}")
    for section, names in _SIZES.items():
        values = record.get(section) or {}
        for name in names:
            required = "transformer_config" in record and name in _REQUIRED.get(section, ())
            if required or values.get(name) is not None:
                _check_size(path, f"{section}.{name}", values.get(name))
    if "world_size" in record:
        _check_size(path, "world_size", record["world_size"])
    return record


def _check_size(path: Path, where: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UserError(
            f"{path}: {where} is {json.dumps(value)[:40]}; expected a whole number above 0: {_FIX}"
        )
    if where.endswith(".num_layers") and value > MAX_LAYERS:  # the predictor's memory walk is quadratic in it
        raise UserError(f"{path}: {where} is {value}, above {MAX_LAYERS}: {_FIX}")
