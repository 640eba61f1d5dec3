"""Thread noise: how far an op's get_data row moves between profiles with one intra-op thread and with two.

    python -m benchmarks.thread_noise [--case llama_small] [--profiles 10] [--op transformer_layer]

benchmarks.predict_accuracy compares rows profiled at one moment with steps run at another, so the
spread of a row over repeated profiles (its A/A) bounds what one round can show. On this project's
2-core VM a two-thread op waits at every parallel region for the slower of the two virtual cores, and so
passes on the stalls of both. This profiles one op (get_data, the accuracy benchmark's point: s128, one
sample a micro-batch, warm) ``--profiles`` times with each thread count, alternated profile by profile
in this one process so that the machine's drift falls on both alike, and prints per thread count and
phase the median row, the largest over the smallest, and the standard deviation over the mean.

What it showed on a 2-core CPU VM (llama-shaped layer, ten profiles each, two runs): with two threads the
forward and backward rows moved by 15% and 12% of their mean (largest over smallest 1.47 and 1.38), and
14.6% and 10.7% (1.56 and 1.38); with one by 6.8% and 2.8% (1.28 and 1.10), and 7.7% and 6.1% (1.28 and
1.18), at 1.2-1.4x the time: the accuracy benchmark's processes have run one thread each since.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import statistics
import tempfile
from pathlib import Path

from autotuner.main import run
from autotuner.ops.naming import PHASES
from autotuner.results import load_rows
from benchmarks._ops import two_or_more
from benchmarks.predict_accuracy import CASES, MBS, SEQ

THREADS = (1, 2)


def _quiet_run(argv: list[str]) -> int:
    """``python -m autotuner.main argv`` in this process (one Megatron import for all the profiles), its
    output dropped."""
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        return run(argv)


def profile(case: list[str], op: str, threads: int, run_dir: Path) -> dict[str, float]:
    """One get_data profile of ``op`` on ``threads`` threads: {phase: its row's median, seconds}."""
    argv = [
        *case,
        f"timing.threads={threads}",
        "device=cpu",
        f"ops=[{op}]",
        f"shapes.seq_len=[{SEQ}]",
        f"shapes.micro_batch_size=[{MBS}]",
        "progress=false",
        "report=false",
        f"hydra.run.dir={run_dir}",
    ]
    if _quiet_run(argv) != 0:
        raise SystemExit(f"the profile of {op} failed: python -m autotuner.main {' '.join(argv)}")
    rows = load_rows(run_dir / "results.jsonl")
    return {row["phase"]: row["median_us"] / 1e6 for row in rows if row["status"] == "ok"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--case", default="llama_small", choices=sorted(CASES))
    parser.add_argument("--op", default="transformer_layer")
    parser.add_argument(
        "--profiles", type=two_or_more("profiles"), default=10, help="profiles per thread count (2 or more)"
    )
    args = parser.parse_args()
    rows: dict[int, list[dict[str, float]]] = {threads: [] for threads in THREADS}
    with tempfile.TemporaryDirectory(prefix="thread-noise-") as folder:
        for index in range(args.profiles * len(THREADS)):
            threads = THREADS[index % len(THREADS)]
            rows[threads].append(profile(CASES[args.case], args.op, threads, Path(folder) / str(index)))
    print(f"{args.case} {args.op}, {args.profiles} profiles per thread count, alternated")
    print(f"{'threads':>7} {'phase':9} {'median ms':>10} {'max/min':>8} {'stdev/mean':>11}")
    for threads, profiles in rows.items():
        for phase in PHASES:
            seconds = [p[phase] for p in profiles if phase in p]
            if len(seconds) < 2:  # the op failed in all profiles but one
                continue
            spread = statistics.stdev(seconds) / statistics.mean(seconds)
            print(
                f"{threads:7} {phase:9} {statistics.median(seconds) * 1e3:10.3f} "
                f"{max(seconds) / min(seconds):8.3f} {spread:11.3f}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
