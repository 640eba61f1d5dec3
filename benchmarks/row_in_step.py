"""A layer's rows, timed as get_data times them, against the same layers inside real training steps: one
process, alternated step by step.

    python -m benchmarks.row_in_step [--cases tiny,llama_small] [--rounds 30] [--threads 1]

The layer's forward and backward rows are most of a predicted step (docs/predict.md).
``benchmarks.predict_accuracy`` compares a profile and real steps taken in different processes, a
minute apart, where a shared VM's drift is as large as the error sought. This takes the drift out: one
process builds the steps' own GPTModel (autotuner.predict.steps: TP1, s128, one sample a micro-batch, 4
micro-batches, fp32), trains it step by step with the steps' hooks timing every layer's visits
(autotuner.predict.in_step.ModuleClock), and after each step times each of its layers alone, as get_data
does (autotuner.runner.Phase and autotuner.measure.timer.DeviceTimer.time_ns: the forward back to back,
each sample right after an untimed call of the same forward; the forward after its backward, each
sample right after an untimed forward and its backward, as ``timing.forward_after_backward`` times it;
the backward after an untimed forward with the layer's gradients cleared), on the input that layer got
in the step. Each round is one step and, in a random order, two samples of each layer's forward (both
ways) and backward, and of each with what the call returns freed inside the timed window (not how get_data
times them: autotuner.measure.timer, "Freeing what a call returns"), and each phase beside earlier calls'
held graphs, as ``timing.held_activations_mib`` holds them, as many MiB
as the step's visits lie on average from their memory's previous use (autotuner.predict.caches.
mean_reuse_distance over the model's stage sweep; autotuner.measure.timer, "Activations a step holds").
On a 2-core Intel VM (one thread, 20 rounds, two runs an hour apart; the first held the 52 MiB the stage
touches a micro-batch, the second the mean distance, 24 MiB): the llama-shaped forward after its backward
0.984 [0.977, 0.996] and 0.962 [0.932, 0.966], held 0.999 [0.985, 1.018] and 0.976 [0.964, 0.995]; its
backward 0.942 [0.940, 0.946] and 0.923 [0.899, 0.934], held 0.991 [0.977, 1.010] and 0.959 [0.948, 0.974];
tiny's forward 1.057 and 1.059, held (4.1 and 1.7 MiB) 1.069 and 1.080, backward 1.098 and 1.108, held 1.119
and 1.108.

It prints per case, per visit: the in-step median and the rows' medians (ms), and each row over the
in-step time, median over the rounds [95% CI, order statistics: 6 rounds at least]. The rows here are
two samples at a time, between other samples of the same layer, not get_data's long back-to-back runs.
What it showed on a 2-core AMD EPYC VM (one thread, 30 rounds, row / in-step): with the host heap kept
(autotuner.model.host_heap), two runs: tiny's forward 0.934 and 0.953, backward 1.053 and 1.062; the
llama-shaped forward 1.009 and 1.043, backward 0.994 and 1.025. With glibc's default heap, two runs: tiny
0.988 and 0.988, 1.059 and 1.045; llama-shaped 1.053 and 1.032, 1.020 and 1.006. Over seven runs the
forward rows' medians read 1.0-11% (tiny) and 1.7-6.7% (llama-shaped, median 2.5%) longer with the
output freed inside their window; the backward's, under 1%. One thread, 20 rounds: tiny's
forward back to back 0.837 [0.813, 0.864], after its backward 0.958 [0.940, 0.980], backward 1.046; the
llama-shaped forward 0.964 [0.949, 0.985] and 1.086 [1.078, 1.103], backward 1.018.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import random
import statistics
from typing import Any

import torch

from autotuner.launchers.get_data import forward_saved_bytes, graphs_to_hold
from autotuner.measure.timer import DeviceTimer, median_ci
from autotuner.ops.naming import PHASES
from autotuner.ops_test.base import OpCall
from autotuner.predict.caches import mean_reuse_distance, stage_sweep
from autotuner.predict.inputs import ModelShape
from autotuner.predict.stage_trainer import StageTrainer
from autotuner.runner import Phase
from benchmarks._ops import dropping_result, two_or_more
from benchmarks.predict_accuracy import CASES, layout_of, threads_per_process

# each kind: (the phase, whether what its call returns is freed inside the timed window); a forward
# sample follows an untimed call of the same forward (back to back, as get_data's blocks run) or, "after
# its backward", that call's backward (timing.forward_after_backward: autotuner.runner.Phase.training_order)
AFTER_BACKWARD = "forward, after its backward"
# timing.held_activations_mib: earlier calls' graphs held as get_data holds them (Phase.training_order)
HELD = ("forward, activations held", "backward, activations held")
KINDS = {
    "forward": ("forward", False),
    AFTER_BACKWARD: ("forward", False),
    "backward": ("backward", False),
    "forward, output freed inside": ("forward", True),
    "backward, graph freed inside": ("backward", True),
    HELD[0]: ("forward", False),
    HELD[1]: ("backward", False),
}
IN_STEP = {"forward": "transformer_layer.forward", "backward": "transformer_layer.backward"}


class Bench:
    """The steps' model of one case in this process, its hooks, and get_data's phases of each layer."""

    def __init__(self, case: str, threads: int) -> None:
        self.layout = layout_of("tp1")
        name, overrides = CASES[case][0].split("=", 1)[1], CASES[case][1:]
        options = [*overrides, "device=cpu", f"timing.threads={threads}"]
        # the steps' own model, batch, gradient buffers, Adam and hooks (its host heap kept, as the
        # profiles and the steps keep theirs)
        self.trainer = StageTrainer(name, options, self.layout)
        (self.model,) = self.trainer.chunks
        self.clock = self.trainer.clock
        self.layers = list(self.model.decoder.layers)
        self.timer = DeviceTimer(self.trainer.device)
        self._inputs: dict[int, tuple[torch.Tensor, dict[str, Any]]] = {}
        handles = [layer.register_forward_pre_hook(self._capture, with_kwargs=True) for layer in self.layers]
        self.step(timed=False)  # one untimed step: first calls, and each layer's input in it
        for handle in handles:
            handle.remove()
        self.phases = [self._phases(layer) for layer in self.layers]
        # the rows' held activations: how far the stage's visits lie on average from their memory's previous
        # use (autotuner.predict.caches), from the model's sizes and the layer's saved bytes
        # (the layers are alike: one layer's figures serve all)
        layer_saved = forward_saved_bytes(self.phases[0]["forward"], list(self.model.parameters()))
        args = self.trainer.spec.model_args
        shape = ModelShape.from_args(name, args)
        self.held_bytes = mean_reuse_distance([stage_sweep(shape, self.layout, 0, layer_saved)])
        self.held_graphs = graphs_to_hold(layer_saved, self.held_bytes)

    def _capture(self, layer: Any, args: tuple, kwargs: dict) -> None:
        if id(layer) not in self._inputs:
            hidden = args[0] if args else kwargs["hidden_states"]
            rest = {
                k: v.detach() if torch.is_tensor(v) else v for k, v in kwargs.items() if k != "hidden_states"
            }
            self._inputs[id(layer)] = (hidden.detach().clone().requires_grad_(), rest)

    def _phases(self, layer: Any) -> dict[str, Phase]:
        hidden, rest = self._inputs[id(layer)]
        call = OpCall(lambda x: layer(x, **rest), (hidden,), layer)
        return {name: Phase(name, call, seed=0) for name in PHASES}

    def step(self, timed: bool) -> None:
        if timed:
            self.clock.start_step()
        self.trainer.forward_backward()
        if timed:
            self.clock.recording = False
            self.clock.collect()
        self.trainer.optimizer_step()  # Adam, then the gradient buffers zeroed

    def rows(self, rng: random.Random) -> dict[str, list[float]]:
        """Two samples of each kind for each layer, in a random order; seconds per call."""
        times: dict[str, list[float]] = {kind: [] for kind in KINDS}
        for layer, phases in zip(self.layers, self.phases, strict=True):
            kept = [p.grad for p in layer.parameters()]  # views of the steps' buffer: back after the rows
            for kind in rng.sample(list(KINDS) * 2, len(KINDS) * 2):
                name, freed_inside = KINDS[kind]
                phase = phases[name]
                graphs = self.held_graphs if kind in HELD else 1
                in_order = kind == AFTER_BACKWARD or kind in HELD
                # held: as many graphs from the start as get_data holds (Phase.training_order)
                with phase.training_order(graphs) if in_order else contextlib.nullcontext():
                    if name == "forward":
                        phase.run()  # the call before: the same forward (then its backward, if after one)
                    if phase.prepare is not None:
                        phase.prepare()
                    # dropped as the call returns, what the call made is freed inside the window
                    run = functools.partial(dropping_result, phase.run) if freed_inside else phase.run
                    times[kind].append(self.timer.time_ns(run) * 1e-9)
            for param, grad in zip(layer.parameters(), kept, strict=True):
                param.grad = grad
        return times


def in_step_times(visits: list[tuple[str, int, float, float]]) -> dict[str, list[float]]:
    return {kind: [end - start for key, _, start, end in visits if key == IN_STEP[kind]] for kind in IN_STEP}


def steps_arguments(description: str, rounds: int) -> tuple[list[str], int, int]:
    """(cases, rounds, intra-op threads) from the command line of a benchmark that trains the steps' own
    model in its process (this one, benchmarks.adam_in_step); ``rounds``: the default."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--cases", default="tiny,llama_small", help="comma-separated: tiny, llama_small")
    parser.add_argument("--rounds", type=two_or_more("rounds"), default=rounds)
    parser.add_argument("--threads", type=threads_per_process, default=1, help="intra-op threads (0: all)")
    args = parser.parse_args()
    cases = args.cases.split(",")
    for case in cases:
        if case not in ("tiny", "llama_small"):
            parser.error(f"--cases {case!r}: give tiny, llama_small or both, comma-separated")
    return cases, args.rounds, args.threads or torch.get_num_threads()


def main() -> None:
    cases, rounds, threads = steps_arguments(__doc__.split("\n\n")[0], 30)
    rng = random.Random(0)
    for case in cases:
        bench = Bench(case, threads)
        rows: dict[str, list[float]] = {kind: [] for kind in KINDS}
        ratios: dict[str, list[float]] = {kind: [] for kind in KINDS}
        inside: dict[str, list[float]] = {kind: [] for kind in IN_STEP}
        for _ in range(rounds):
            bench.step(timed=True)
            visits = in_step_times(bench.clock.timelines[-1])
            times = bench.rows(rng)
            for kind in KINDS:
                base = KINDS[kind][0]
                rows[kind] += times[kind]
                ratios[kind].append(statistics.median(times[kind]) / statistics.median(visits[base]))
            for kind in IN_STEP:
                inside[kind] += visits[kind]
        print(
            f"{case} TransformerLayer, TP1 s{bench.layout.seq_len} b{bench.layout.micro_batch_size}, "
            f"{bench.layout.microbatches} micro-batches, fp32, {threads} thread(s), {rounds} rounds: "
            "per visit, median ms; row / in-step, median over the rounds [95% CI]; activations held: "
            f"{bench.held_bytes / 2**20:.1f} MiB, the stage's mean reuse distance "
            f"({bench.held_graphs} graphs)"
        )
        for kind in KINDS:
            base = KINDS[kind][0]
            ordered = sorted(ratios[kind])
            ci = median_ci(ordered)
            interval = f"[{ci[0]:.3f}, {ci[1]:.3f}]" if ci else "[-]"
            in_step_ms, row_ms = statistics.median(inside[base]) * 1e3, statistics.median(rows[kind]) * 1e3
            print(
                f"  {kind:<30} in-step {in_step_ms:7.3f}  row {row_ms:7.3f}  "
                f"{statistics.median(ordered):.3f} {interval}",
                flush=True,
            )


if __name__ == "__main__":
    main()
