"""``prediction.json``'s schema version, checked by each reader: the predictor's ``Prediction.from_json``
and the page (autotuner.report.prediction), which reads the plain data without the predictor. The file is
``dataclasses.asdict`` of the Prediction, so any change to a field of it, or of what it holds, is a new
version: a reader refuses another version in one line rather than misread it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from autotuner.errors import UserError

SCHEMA_VERSION = 2  # 1: the hand-written record before it


def check_schema(record: Mapping[str, Any], where: str = "the prediction") -> None:
    """UserError (one line) unless ``record`` is of :data:`SCHEMA_VERSION`."""
    version = record.get("schema_version", 1)
    if version != SCHEMA_VERSION:
        raise UserError(
            f"{where} is of prediction schema_version {version!r}, this autotuner reads {SCHEMA_VERSION}: "
            "predict again with this version (python -m autotuner.predict)"
        )
