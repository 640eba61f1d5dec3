"""Megatron-LM's published H100 weak-scaling runs, predicted: per-GPU TFLOP/s side by side with the error.

    python -m benchmarks.megatron_published [--fixture tests/fixtures/h100_megatron_gpt] [--cluster dgx_h100]

The runs are Megatron-LM's README, "Training Speed and Scalability" (its table, images/model_table.png,
added in commit f2e5db402c of github.com/NVIDIA/Megatron-LM): GPT models of vocabulary 131,072 and
sequence 4,096, heads x 128 = hidden, a 4h MLP, DP 48, global batch 192, on H100s, with
``--overlap-grad-reduce --overlap-param-gather --tp-comm-overlap`` (so the distributed optimizer and, at
TP > 1, sequence parallelism). The models are the cases ``megatron_gpt_*`` (their notes say how the
starcoder2 family expresses Megatron's GPT, and where it differs). Per-GPU TFLOP/s is Megatron's own
count (autotuner.predict.megatron_formulas, the formula of that commit) over the predicted step and the
GPUs.

Each model is predicted from the fixture's profile of one layer of an emulated rank at its TP (bf16,
attention=sdpa, the device calibration kept beside it: scripts/make_h100_fixture.sh makes it on one
H100) at the case's depth, over the cluster's links (the DGX H100 preset by default: the published runs
do not name theirs), by ``autotuner.tune``'s ranking kept within the stated layout: what the run does not
state (micro-batch size, recompute) is tune's best choice that fits the H100's 80 GB, said in the table.
Beside each: the memory per GPU of that layout against Megatron-LM's theoretical-memory report, term by
term (its parameter count, its weights and optimizer, its activations), as autotuner.predict.memory
computes the report.

Without the fixture it says so and what makes it (exit 2). The target is every row within 10%.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autotuner.errors import UserError

FIXTURE = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "h100_megatron_gpt"
MAKES_IT = "bash scripts/make_h100_fixture.sh on a machine with one H100 (docs/cluster_model.md)"
TARGET = 0.10


@dataclass(frozen=True)
class Published:
    """One row of Megatron-LM's table: the case, its stated layout, and its per-GPU TFLOP/s."""

    name: str
    case: str
    layers: int
    tp: int
    gpus: int
    global_batch_size: int
    tflops: float


PUBLISHED = (
    Published("1.7B", "megatron_gpt_1_7b", 24, 1, 48, 192, 408.8),
    Published("7.1B", "megatron_gpt_7_1b", 30, 2, 96, 192, 465.9),
    Published("16B", "megatron_gpt_16b", 32, 4, 192, 192, 489.1),
    Published("32B", "megatron_gpt_32b", 48, 8, 384, 192, 459.6),
)
SEQ_LEN, DP, GPU_MEMORY_GB = 4096, 48, 80.0


@dataclass(frozen=True)
class Row:
    """One model predicted: the published row, the layout chosen and its prediction."""

    published: Published
    prediction: Any  # autotuner.predict.prediction.Prediction
    tflops: float  # Megatron's FLOPs / predicted step / GPUs, in TFLOP/s
    shard_params: float  # Megatron's count of the most loaded shard's parameters

    @property
    def error(self) -> float:
        return self.tflops / self.published.tflops - 1


def stated(published: Published) -> Any:
    """Whether a layout is the published run's (its TP, PP 1, DP 48, overlaps on: the distributed
    optimizer, and sequence parallelism at TP > 1)."""

    def keep(layout: Any) -> bool:
        return (
            layout.tp == published.tp
            and layout.pp == 1
            and layout.cp == 1
            and layout.dp == DP
            and layout.distributed_optimizer
            and layout.overlap_grad_reduce
            and layout.overlap_param_gather
            and layout.sequence_parallel == (published.tp > 1)
        )

    return keep


def predict_row(published: Published, fixture: Path, cluster: str) -> Row:
    """The published run predicted from the fixture's profile of its model (module docstring)."""
    from autotuner.predict.megatron_formulas import megatron_flops_per_step, megatron_shard_parameters
    from autotuner.tune import rank

    run = fixture / published.case
    settings = {
        "gpus": published.gpus,
        "gpu_memory_gb": GPU_MEMORY_GB,
        "global_batch_size": published.global_batch_size,
        "seq_len": SEQ_LEN,
        "dtype": "bf16",
        "cluster": cluster,
        "overlap": True,
        "num_layers": published.layers,
    }
    ranked, _ = rank([str(run)], settings, keep=stated(published))
    fitting = [r for r in ranked if r.fits]
    if not fitting:
        raise UserError(f"{published.name}: no layout of the published run fits {GPU_MEMORY_GB:g} GB")
    best = fitting[0].prediction
    flops = megatron_flops_per_step(best.model, best.layout)
    return Row(
        published,
        best,
        flops / best.step_seconds / best.layout.gpus / 1e12,
        megatron_shard_parameters(best.model, best.layout),
    )


def _gib(value: float) -> str:
    return f"{value / 2**30:.1f}"


def render(rows: list[Row], fixture: Path, cluster: str) -> str:
    """The side-by-side table and the memory comparison."""
    lines = [
        f"Megatron-LM's H100 weak-scaling runs (README, f2e5db402c) predicted from {fixture}, "
        f"cluster {cluster}",
        f"{'model':6} {'GPUs':>5} {'mbs':>4} {'recompute':>10} {'step s':>8} {'TFLOP/s/GPU':>12} "
        f"{'published':>10} {'error':>7}",
    ]
    for row in rows:
        lay = row.prediction.layout
        lines.append(
            f"{row.published.name:6} {lay.gpus:>5} {lay.micro_batch_size:>4} {lay.recompute:>10} "
            f"{row.prediction.step_seconds:>8.3f} {row.tflops:>12.1f} {row.published.tflops:>10.1f} "
            f"{row.error:>+7.1%}"
        )
    worst = max(abs(row.error) for row in rows)
    lines.append(
        f"worst error {worst:.1%}: {'within' if worst <= TARGET else 'outside'} the {TARGET:.0%} target "
        "(micro-batch size and recompute: tune's best that fits 80 GB, the runs do not state them)"
    )
    lines += [
        "",
        "memory per GPU, GiB: predicted (weights + grads + optimizer | activations + logits | in flight | "
        "Adam step | total) against Megatron-LM's report (shard parameters | weights and optimizer | "
        "activations | total)",
    ]
    from autotuner.predict.memory import megatron_report

    for row in rows:
        memory = row.prediction.memory[0]
        report = megatron_report(row.prediction.model, row.prediction.layout, row.shard_params)
        lines.append(
            f"{row.published.name:6} predicted {_gib(memory.resident)} | "
            f"{_gib(memory.activations.value + memory.logits.value)} | {_gib(memory.in_flight.value)} | "
            f"{_gib(memory.optimizer_step.value)} | {_gib(memory.total)}   Megatron "
            f"{row.shard_params / 1e9:.3f}e9 (ours {memory.params.value / 1e9:.3f}e9) | "
            f"{_gib(report.weights_and_optimizer.value)} | {_gib(report.activations.value)} | "
            f"{_gib(report.total)}"
        )
    return "\n".join(lines)


def run(fixture: Path, cluster: str) -> list[Row]:
    """Every published row predicted; UserError (one line) where the fixture is missing."""
    missing = [p.case for p in PUBLISHED if not (fixture / p.case / "results.jsonl").is_file()]
    if missing:
        raise UserError(f"the H100 fixture {fixture} lacks {', '.join(missing)}: it is made by {MAKES_IT}")
    return [predict_row(published, fixture, cluster) for published in PUBLISHED]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--fixture", type=Path, default=FIXTURE, help="the profiles (default: the H100 fixture)"
    )
    parser.add_argument("--cluster", default="dgx_h100", help="a cluster preset or file (default dgx_h100)")
    args = parser.parse_args(argv)
    try:
        rows = run(args.fixture, args.cluster)
    except UserError as exc:
        print(f"benchmarks.megatron_published: {exc}", file=sys.stderr)
        return 2
    print(render(rows, args.fixture, args.cluster))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
