"""Instrumentation overhead: a transformer_layer forward+backward with our instrumented ops over the
same layer built from stock Megatron modules, no profiler attached.

    python benchmarks/instrumentation_overhead.py

Both layers are built from the same spec and seed (same weights), fed the same input; rounds alternate
between them (ABBA) so drift affects both, and the ratio is the median over rounds. One intra-op thread
by default (``--threads``): on a small shared machine a 2-thread OpenMP region stalls whenever another
process takes a core, which swamps a 1% effect. Target: ratio <= 1.01.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from autotuner.model import build_model
from autotuner.op_mapping import model_parts
from autotuner.ops_test.base import OpContext
from autotuner.runtime import DTYPES
from autotuner.spec import open_session
from benchmarks._ops import POINT, spec_for

ROUNDS = 31
ITERATIONS = 20


def _step(layer, x, mask, rotary, grad) -> None:
    out, _ = layer(x, attention_mask=mask, rotary_pos_emb=rotary)
    out.backward(grad)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    spec = spec_for(["ops=[transformer_layer]", f"timing.threads={parser.parse_args().threads}"])
    instrumented, context = open_session(spec)  # also starts the process group
    torch.manual_seed(spec.seed)
    parts = model_parts(spec.ops, spec.block_layers, spec.model_args.tie_word_embeddings)
    stock = build_model(spec.model_args, spec.tf_config, parts, spec.device, False, instrument=False)
    stock.load_state_dict(instrumented.state_dict())
    ctx = OpContext(stock, spec.device, DTYPES[spec.dtype], spec.seed)
    x = context.hidden(POINT)
    mask, rotary = ctx.causal_mask(POINT), ctx.rotary(POINT)
    grad = torch.randn_like(x)
    layers = {"instrumented": instrumented.decoder.layers[0], "stock": stock.decoder.layers[0]}
    assert type(layers["instrumented"]).__name__.startswith("Instrumented")
    assert not type(layers["stock"]).__name__.startswith("Instrumented")
    times = {name: [] for name in layers}
    for layer in layers.values():  # warm-up
        for _ in range(3):
            _step(layer, x, mask, rotary, grad)
    for round_ in range(ROUNDS):
        order = list(layers.items())
        for name, layer in order if round_ % 2 == 0 else reversed(order):
            begin = time.perf_counter_ns()
            for _ in range(ITERATIONS):
                _step(layer, x, mask, rotary, grad)
            times[name].append((time.perf_counter_ns() - begin) / ITERATIONS / 1e3)
    ratios = [i / s for i, s in zip(times["instrumented"], times["stock"], strict=True)]
    ratio = statistics.median(ratios)
    print(f"transformer_layer fwd+bwd at {POINT.label}, hidden {spec.tf_config.hidden_size}:")
    print(f"  stock        {statistics.median(times['stock']):9.1f} us")
    print(f"  instrumented {statistics.median(times['instrumented']):9.1f} us")
    print(
        f"  ratio {ratio:.4f} (median over {ROUNDS} alternating rounds; target <= 1.01): "
        f"{'met' if ratio <= 1.01 else 'NOT met'}"
    )


if __name__ == "__main__":
    main()
