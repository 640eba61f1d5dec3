"""Capture overhead: a transformers Llama training step (forward, backward, AdamW) with the recorder
installed and recording over the same step without it.

    python benchmarks/capture_overhead.py [--threads N] [--rounds R]

Two models: the tests' tiny Llama (hidden 64, 2 layers, 2 x 16 tokens: a step of a few milliseconds,
so the recorder's fixed cost per call shows in full) and a small real one (hidden 512, 4 layers,
2 x 256 tokens). Rounds alternate between the two modes, in ABBA order, so machine drift hits both alike;
the printed times are medians over rounds of the mean step time in a round, and the per-call cost is the
difference over the calls one step records.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from autotuner.capture import capture

MODELS = {
    "tiny (h64, 2 layers, 2x16)": (dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2), 16),
    "small (h512, 4 layers, 2x256)": (
        dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=4),
        256,
    ),
}
STEPS = 5


def _model(sizes: dict[str, int]) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(num_attention_heads=8, num_key_value_heads=4, vocab_size=1024, **sizes)
    return LlamaForCausalLM(config)


def _steps(model: LlamaForCausalLM, optimizer: torch.optim.Optimizer, ids: torch.Tensor) -> float:
    start = time.perf_counter()
    for _ in range(STEPS):
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return (time.perf_counter() - start) / STEPS


def measure(sizes: dict[str, int], seq: int, rounds: int, out: Path) -> tuple[float, float, int]:
    model = _model(sizes)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, 1024, (2, seq))
    _steps(model, optimizer, ids)  # warm-up: lazy initialisation, allocator, optimizer state
    plain, captured = [], []
    calls = 0
    for index in range(rounds):
        for mode in ("plain", "captured") if index % 2 == 0 else ("captured", "plain"):  # ABBA: no order bias
            if mode == "plain":
                plain.append(_steps(model, optimizer, ids))
                continue
            with capture(out) as recorder:
                captured.append(_steps(model, optimizer, ids))
            calls = sum(r.count for r in recorder.records()) // STEPS
    return statistics.median(plain), statistics.median(captured), calls


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: default)")
    parser.add_argument("--rounds", type=int, default=11)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.rounds} rounds of {STEPS} steps"
    )
    print(f"{'model':32} {'plain':>10} {'captured':>10} {'overhead':>9} {'calls/step':>10} {'per call':>9}")
    with tempfile.TemporaryDirectory() as folder:
        for label, (sizes, seq) in MODELS.items():
            plain, captured, calls = measure(sizes, seq, args.rounds, Path(folder) / "c.json")
            per_call = (captured - plain) / calls * 1e6 if calls else float("nan")
            print(
                f"{label:32} {plain * 1e3:8.2f}ms {captured * 1e3:8.2f}ms {captured / plain - 1:+8.1%} "
                f"{calls:10d} {per_call:7.1f}us"
            )


if __name__ == "__main__":
    main()
