"""A layer's forward as its row times it (back to back) against as a training step runs it (after its
backward), on this machine, side by side.

    python -m benchmarks.forward_after_backward [--case tiny|llama_small] [--threads 1] [--samples 600]
        [--rounds 3]

get_data times an op's forward in back-to-back calls (autotuner.measure.timer), each finding what the
previous call left in the caches. Inside a training step a layer's forward follows the previous micro-
batch's backward instead (the no-pipelining and 1F1B schedules alternate them), which touched the layer's
gradients and saved activations in between and took time. This times one TransformerLayer's forward
(the case's real Megatron layer, at s128, one sample) after each of these, chosen at random sample by
sample so that the machine's drift falls on every condition alike:

* ``back to back``: after its own forward, as the row's samples run;
* ``after its backward``: after a forward and its backward (untimed), as in a training step;
* ``after a spin``: after spinning as long as that backward takes, touching nothing: the time alone;
* ``after a flush``: after writing a buffer twice the last-level cache, as a flushed row's samples run;
* ``after another layer``: after the forward of a second layer of the same shapes (its own weights, the
  same code), as each layer's forward in a step follows the previous layer's;
* ``after a flush, another layer``: the flush, then the other layer's forward, which does not touch this
  layer's weights: evicted as after the flush, but run after its own code and the memory it recycles
  (what the clause of autotuner.predict.caches.warm_visits for a visit right after the same op's
  rests on).

It prints each condition's median (95% CI, order statistics) and its ratio to back to back. What it
showed on a 2-core CPU VM (three rounds of 600 samples each), with each timed forward's output freed
inside its window: the tiny layer's forward (one thread, 1.3-1.5 ms back to back) took
1.16-1.23x that after its backward, 1.16-1.31x after a spin as long, 1.63-1.76x after a flush; the
llama-shaped layer's (4.5-5.0 ms) 1.04-1.09x after its backward, 1.13-1.18x after a spin, 1.09-1.15x
after a flush (two threads and one). With each timed forward's output freed after its end mark, as
get_data's timer frees it (autotuner.measure.timer, "Freeing what a call returns"); so
timed, one thread, three rounds each: tiny (1.5-1.7 ms back to back) 1.11-1.20x after its backward,
1.19-1.27x after a spin, 1.28-1.41x after a flush; llama-shaped (4.6-5.0 ms) 1.06-1.09x, 1.17-1.21x,
1.11-1.13x. Time alone, touching nothing, slows the next call as much as the backward does: the rows'
back-to-back forwards are a lower bound of a step's on this machine, by this benchmark's conditions
(``benchmarks.row_in_step`` compares them with the steps' own forwards). With the two conditions after
another layer, one thread, three rounds each: tiny (1.4-1.6 ms back to back) 1.08-1.16x
after its backward, 1.11-1.20x after a spin, 1.30-1.68x after a flush, 0.98-1.02x after another layer,
1.01-1.09x after a flush and another layer; llama-shaped (4.2-4.4 ms) 1.11-1.12x,
1.14-1.21x, 1.09-1.16x, 1.01x, 1.03-1.04x.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable

import torch

from autotuner.config import compose_config
from autotuner.measure.cache import CacheFlusher
from autotuner.measure.timer import DeviceTimer, median_ci
from autotuner.ops_test.base import OpCall, ShapePoint
from autotuner.runner import Phase
from autotuner.runner.spec import open_session, resolve_spec
from benchmarks.predict_accuracy import CASES

POINT = ShapePoint(128, 1)
CONDITIONS = (
    "back to back",
    "after its backward",
    "after a spin",
    "after a flush",
    "after another layer",
    "after a flush, another layer",
)


def layer_phases(case: str, threads: int) -> tuple[Phase, Phase, Phase]:
    """The case's TransformerLayer op, fp32 on the CPU: its forward and backward phases, and the forward
    of a second layer of the same shapes (built apart: its own weights)."""
    spec = resolve_spec(compose_config([*CASES[case], "device=cpu", "dtype=fp32", "ops=[transformer_layer]"]))
    _, context = open_session(spec)
    torch.set_num_threads(threads)
    (test,) = spec.ops
    call = test.build(context, POINT)
    # the second layer: this layer's code run on weights of its own (copies, bound in for its call only;
    # a deep copy of a Megatron layer fails on its process groups)
    params = list(call.module.parameters())
    twins = [param.detach().clone() for param in params]

    def twin_forward(x: torch.Tensor) -> object:
        own = [param.data for param in params]
        for param, twin in zip(params, twins, strict=True):
            param.data = twin
        try:
            return call.fn(x)
        finally:
            for param, data in zip(params, own, strict=True):
                param.data = data

    other = OpCall(twin_forward, (context.hidden(POINT),), call.module)
    return Phase("forward", call, seed=0), Phase("backward", call, seed=0), Phase("forward", other, seed=1)


def one_round(
    forward: Phase, backward: Phase, other: Phase, samples: int, rng: random.Random
) -> dict[str, list[float]]:
    """``samples`` timed forwards, each after a condition drawn at random."""
    backward_s = [1e-3]
    timer = DeviceTimer(torch.device("cpu"))

    def after_backward() -> None:
        backward.prepare()
        start = time.perf_counter()
        backward.run()
        backward_s.append(time.perf_counter() - start)

    def spin() -> None:
        until = time.perf_counter() + statistics.median(backward_s[-50:])
        while time.perf_counter() < until:
            pass

    flush = CacheFlusher(torch.device("cpu"))  # the timer's own flush

    def flush_then_other() -> None:
        flush()
        other.run()

    before: dict[str, Callable[[], object]] = {
        "back to back": forward.run,
        "after its backward": after_backward,
        "after a spin": spin,
        "after a flush": flush,
        "after another layer": other.run,
        "after a flush, another layer": flush_then_other,
    }
    times: dict[str, list[float]] = {name: [] for name in CONDITIONS}
    for _ in range(samples):
        name = rng.choice(CONDITIONS)
        before[name]()
        times[name].append(timer.time_ns(forward.run) * 1e-9)  # the row's timer: output freed after its end
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--case", choices=("tiny", "llama_small"), default="tiny")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--samples", type=int, default=600)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    forward, backward, other = layer_phases(args.case, args.threads)
    rng = random.Random(0)
    one_round(forward, backward, other, 40, rng)  # warm-up: first calls, the allocator's pools
    print(
        f"{args.case} TransformerLayer forward, s{POINT.seq_len} b{POINT.micro_batch_size}, fp32, "
        f"{args.threads} thread(s); median ms [95% CI] and / back to back"
    )
    for index in range(args.rounds):
        times = one_round(forward, backward, other, args.samples, rng)
        base = statistics.median(times["back to back"])
        cells = []
        for name in CONDITIONS:
            ordered = sorted(times[name])
            median = statistics.median(ordered)
            ci = median_ci(ordered)
            interval = f"[{ci[0] * 1e3:.3f}, {ci[1] * 1e3:.3f}]" if ci else "[-]"
            cells.append(f"{name} {median * 1e3:.3f} {interval} {median / base:.2f}x")
        print(f"round {index + 1}: " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
