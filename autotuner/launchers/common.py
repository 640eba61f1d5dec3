"""What every launcher does around the runner: the run record on disk and the closing summary."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from autotuner.results import ResultsWriter, load_rows, merge_ranks
from autotuner.runtime import environment
from autotuner.table import render


def process_rank() -> tuple[int, int]:
    """(rank, world size) from the launcher's environment (torchrun sets RANK and WORLD_SIZE)."""
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def start_writer(cfg: DictConfig, spec: Any, run_dir: Path) -> ResultsWriter:
    """Write ``environment.json`` (versions, device, the derived model config) and open the results.

    With several processes each rank writes its own ``results.rank<N>.{jsonl,csv}``; :func:`finish`
    merges them into ``results.{jsonl,csv}`` on rank 0.
    """
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    rank, world = process_rank()
    stem = f"results.rank{rank}" if world > 1 else "results"
    if rank != 0:
        return ResultsWriter(run_dir, resume=bool(cfg.resume), stem=stem)
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
        "world_size": world,
    }
    (run_dir / "environment.json").write_text(json.dumps(record, indent=2, default=repr) + "\n")
    for note in spec.notes:
        print(f"note: {note}", file=sys.stderr)
    return ResultsWriter(run_dir, resume=bool(cfg.resume), stem=stem)


def finish(writer: ResultsWriter, spec: Any) -> int:
    """Print the summary table and where the files are; 1 if any measurement failed, else 0.

    With several ranks: wait for all, then rank 0 merges every rank's rows (plus the cross-rank
    ``max`` rows) into ``results.{jsonl,csv}`` and prints the table of those; other ranks print nothing.
    """
    rank, world = process_rank()
    if world > 1:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.barrier()
        if rank != 0:
            return 0
        merged = ResultsWriter(writer.run_dir)
        per_rank = [load_rows(writer.run_dir / f"results.rank{r}.jsonl") for r in range(world)]
        merged.extend(merge_ranks(per_rank))
        writer = merged
        rows = [r for r in writer.rows if r.get("case") == spec.case and r.get("rank") == "max"]
    else:
        rows = [r for r in writer.rows if r.get("case") == spec.case]
    print(render(rows))
    failed = [r for r in rows if r.get("status") == "failed"]
    print(f"\n{len(rows)} rows ({len(failed)} failed) in {writer.run_dir}/results.csv and results.jsonl")
    return 1 if failed else 0
