"""The Adam step inside real training steps against the calibration's rates, and what makes them differ:
one process, alternated step by step.

    python -m benchmarks.adam_in_step [--cases tiny,llama_small] [--rounds 12] [--threads 1]

The predictor times a step's optimizer from ``autotuner.calibrate``'s Adam rates: seconds per parameter
and per tensor, solved from ``torch.optim.Adam.step`` over two sets of fp32 tensors (zeros, every gradient
1e-3), plus a once-a-step extra timed in the minimal model's steps (autotuner.predict.timing,
``optimizer_step``). ``benchmarks.predict_accuracy`` found the llama-shaped model's Adam inside its steps
at 1.23-1.34x a prediction without the zero-state and once-a-step terms on a 2-core CPU VM, every
round. This builds the steps' own GPTModel
(autotuner.predict.steps: TP1, s128, one sample a micro-batch, 4 micro-batches, fp32) and, in each round,
one training step, then in a random order one Adam step of each kind, all over the model's parameter
shapes, so that each step between two kinds tells one cause apart:

* ``in the step``: the steps' own Adam (their optimizer, masters and gradient buffers) right after the
  forward-backward, as a training step runs it (the gradients' zeroing is not in it);
* ``back to back``: the same optimizer's step again at once (its data as the first one left them);
* ``after a write over the cache``: the same after writing a buffer four times the shared cache (the
  flush: autotuner.measure.cache.CacheFlusher), which leaves the cache full of lines to write back, as a
  backward leaves it (it writes the gradients);
* ``after a read over the cache``: the same after reading that buffer, which leaves the cache full of
  clean lines;
* ``separate tensors, the step's gradients``: a fresh Adam over copies of the parameters, each gradient
  its own tensor holding the step's values (not a view of the steps' flat gradient buffer);
* ``separate tensors, gradients 1e-3``: the same with the calibration's constant gradients;
* ``the calibration's rates``: what ``autotuner.calibrate.adam_rates`` and ``adam_zero_state_seconds``,
  timed once before the rounds and once after (their mean), give for these shapes: per parameter x
  parameters + per tensor x tensors + per zero-state parameter x the parameters whose gradient the step
  left zero (the embedding's rows no token touched; counted, and beside it the predictor's expectation,
  autotuner.predict.inputs.ModelShape.untouched_embedding_params).

It prints each kind's median ms over the rounds and its ratio to the calibration's rates, median over the
rounds [95% CI, order statistics: 6 rounds at least]; then the zeroing of the gradient buffers that ends
each round's last step (after its Adam, as a training step zeroes them for the next), beside what the
calibration's zeroing rate (``zeroing_bandwidth``, the predictor's) and its copy bandwidth give for them.

What it showed on a 2-core CPU VM (one thread, 12 rounds, each ratio over the per-parameter and per-tensor
rates alone, without the zero-state rate), two runs: the llama-shaped model's Adam in
the step 1.313 and 1.195, back to back 1.165 and 1.121, over separate tensors with the step's gradients
1.176 and 1.144, with gradients 1e-3 1.054 and 1.015; after a write over the cache 1.164, after a read
1.271. The step's gradients against constant ones cost 12% more: 925,696 of its 5.26 M parameters (the
embedding's rows no token touched) have zero gradients, and a CPU Adam step over zero moments took 2.4 ns
a parameter more than over others (``torch.sqrt`` of zeros ran about ten times slower than of other
values there). Tiny: 1.562, 1.196, 1.045, 0.969 (its once-a-step extra, ``adam_seconds_per_step_in_
training``, not in this prediction, is most of that first ratio). With the zero-state rate, three llama-shaped
runs: in the step 1.072, 1.300 (a noisy hour: the rate 3.89 ns a parameter before the rounds, 4.43 after) and
1.065, back to back 1.016, 1.076, 0.958; the zeroing of its 21 MB of gradients after Adam (the last two) 2.90
and 2.43 ms, 2.82 and 2.77 from the calibration's zeroing rate, 1.84 and 1.79 from its copy bandwidth.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable

import torch

from autotuner.calibrate import POLICY, adam_rates, adam_zero_state_seconds, memory_rates
from autotuner.measure.cache import CacheFlusher
from autotuner.measure.timer import median_ci
from autotuner.predict.inputs import ModelShape
from autotuner.predict.stage_trainer import StageTrainer
from benchmarks.predict_accuracy import CASES, layout_of
from benchmarks.row_in_step import steps_arguments

IN_STEP, BACK_TO_BACK = "in the step", "back to back"
AFTER_WRITE, AFTER_READ = "after a write over the cache", "after a read over the cache"
STEP_GRADS, CONSTANT_GRADS = "separate tensors, the step's gradients", "separate tensors, gradients 1e-3"
KINDS = (IN_STEP, BACK_TO_BACK, AFTER_WRITE, AFTER_READ, STEP_GRADS, CONSTANT_GRADS)


def _seconds(run: Callable[[], object]) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def _fresh_adam(masters: list[torch.Tensor], step_grads: bool) -> torch.optim.Adam:
    """An Adam over copies of ``masters``, each gradient its own tensor (the step's values or 1e-3), its
    states made by an untimed first step."""
    params = []
    for master in masters:
        param = master.detach().clone().requires_grad_()
        param.grad = master.grad.detach().clone() if step_grads else torch.full_like(param, 1e-3)
        params.append(param)
    optimizer = torch.optim.Adam(params, lr=1e-6)
    optimizer.step()
    return optimizer


def _calibration_rates(device: torch.device) -> tuple[float, float, float, float, float]:
    """(per parameter, per tensor, per zero-state parameter, copy bandwidth, zeroing bandwidth) as
    autotuner.calibrate times them."""
    per_parameter, per_tensor, _ = adam_rates(device, POLICY)
    zero_state = adam_zero_state_seconds(device, POLICY, per_parameter, per_tensor)
    return per_parameter, per_tensor, zero_state, *memory_rates(device, POLICY)[:2]


def bench(case: str, rounds: int, threads: int, rng: random.Random) -> None:
    name, overrides = CASES[case][0].split("=", 1)[1], CASES[case][1:]
    layout = layout_of("tp1")
    trainer = StageTrainer(name, [*overrides, "device=cpu", f"timing.threads={threads}"], layout)
    device, masters = trainer.device, trainer.masters
    flush = CacheFlusher(device)
    for _ in range(2):  # first calls; Adam's states made
        trainer.forward_backward()
        zeros = sum(int((m.grad == 0).sum()) for m in masters)  # the same every step: one global batch
        trainer.optimizer_step()
    rates = [_calibration_rates(device)]
    params, tensors = sum(m.numel() for m in masters), len(masters)
    args = trainer.spec.model_args
    shape = ModelShape.from_args(name, args, tf_config=trainer.spec.tf_config)
    expected = shape.untouched_embedding_params(1, layout.global_batch_size * layout.seq_len)
    times: dict[str, list[float]] = {kind: [] for kind in KINDS}
    zeroing: list[float] = []
    for _ in range(rounds):
        trainer.forward_backward()
        times[IN_STEP].append(_seconds(trainer.optimizer.step))
        copies = {STEP_GRADS: _fresh_adam(masters, True), CONSTANT_GRADS: _fresh_adam(masters, False)}
        runs = {BACK_TO_BACK: trainer.optimizer.step, **{kind: adam.step for kind, adam in copies.items()}}
        runs |= {AFTER_WRITE: trainer.optimizer.step, AFTER_READ: trainer.optimizer.step}
        for kind in rng.sample(list(runs), len(runs)):
            if kind == AFTER_WRITE:
                flush()
            elif kind == AFTER_READ:
                flush.buffer.sum()
            times[kind].append(_seconds(runs[kind]))
        del copies, runs
        # the round's last Adam step, then the gradients' zeroing for the next step, as a step ends
        trainer.optimizer.step()
        zeroing.append(_seconds(trainer.zero_gradients))
    rates.append(_calibration_rates(device))
    per_parameter, per_tensor, per_zero, copy_bw, zeroing_bw = (
        statistics.fmean(r[i] for r in rates) for i in range(5)
    )
    predicted = per_parameter * params + per_tensor * tensors + per_zero * zeros
    cleared = sum(buffer.flat.numel() * buffer.flat.element_size() for buffer in trainer.buffers)
    print(
        f"{case}: Adam over {params:,} parameters in {tensors} tensors, {zeros:,} of them with zero "
        f"gradients (the predictor expects {expected:,.0f}), fp32, {threads} thread(s), {rounds} rounds; the "
        f"calibration's rates {rates[0][0] * 1e9:.2f} and {rates[1][0] * 1e9:.2f} ns a parameter (before / "
        f"after), {per_tensor * 1e6:.1f} us a tensor, {per_zero * 1e9:.2f} ns more a zero-state parameter: "
        f"{predicted * 1e3:.2f} ms ({(predicted - per_zero * zeros) * 1e3:.2f} without the zero-state rate). "
        "Median ms; / the calibration's rates, median over the rounds [95% CI]"
    )
    for kind in KINDS:
        ordered = sorted(seconds / predicted for seconds in times[kind])
        ci = median_ci(ordered)
        interval = f"[{ci[0]:.3f}, {ci[1]:.3f}]" if ci else "[-]"
        print(
            f"  {kind:<40} {statistics.median(times[kind]) * 1e3:8.2f}  {statistics.median(ordered):.3f} "
            f"{interval}",
            flush=True,
        )
    # what the predictor adds after Adam (autotuner.predict.timing.gradient_zeroing_seconds), both ways
    took = statistics.median(zeroing)
    print(
        f"  zeroing the {cleared / 1e6:.1f} MB of gradient buffers after it: {took * 1e3:.2f} ms; at the "
        f"calibration's zeroing rate {zeroing_bw / 1e9:.2f} GB/s {cleared / zeroing_bw * 1e3:.2f} ms, at "
        f"its copy bandwidth {copy_bw / 1e9:.2f} GB/s {cleared / copy_bw * 1e3:.2f} ms",
        flush=True,
    )


def main() -> None:
    cases, rounds, threads = steps_arguments(__doc__.split("\n\n")[0], 12)
    torch.set_num_threads(threads)
    rng = random.Random(0)
    for case in cases:
        bench(case, rounds, threads, rng)


if __name__ == "__main__":
    main()
