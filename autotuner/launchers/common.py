"""What every launcher does around the runner: the run record on disk and the closing summary."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from autotuner.results import ResultsWriter
from autotuner.runtime import environment
from autotuner.table import render


def start_writer(cfg: DictConfig, spec: Any, run_dir: Path) -> ResultsWriter:
    """Write ``environment.json`` (versions, device, the derived model config) and open the results."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    record = {
        "environment": environment(spec.device),
        "case": spec.case,
        "dtype": spec.dtype,
        "points": [p.label for p in spec.points],
        "ops": [op.name for op in spec.ops],
        "transformer_engine_spec": spec.use_transformer_engine,
        "transformer_config": {
            k: (v if isinstance(v, (int, float, str, bool, type(None))) else repr(v))
            for k, v in vars(spec.tf_config).items()
            if not k.startswith("_")
        },
        "model_args": {k: v for k, v in vars(spec.model_args).items()},
        "notes": spec.notes,
    }
    (run_dir / "environment.json").write_text(json.dumps(record, indent=2, default=repr) + "\n")
    for note in spec.notes:
        print(f"note: {note}", file=sys.stderr)
    return ResultsWriter(run_dir, resume=bool(cfg.resume))


def finish(writer: ResultsWriter, spec: Any) -> int:
    """Print the summary table and where the files are; 1 if any measurement failed, else 0."""
    rows = [r for r in writer.rows if r.get("case") == spec.case]
    print(render(rows))
    failed = [r for r in rows if r.get("status") == "failed"]
    print(f"\n{len(rows)} rows ({len(failed)} failed) in {writer.run_dir}/results.csv and results.jsonl")
    return 1 if failed else 0
