"""Prediction accuracy: predicted step time and peak memory / measured, on real training steps.

    python -m benchmarks.predict_accuracy [--repeats 7] [--rounds 6] [--cases tiny,llama_small,tiny_moe]
        [--layouts tp1,tp2,pp2,vpp2,dp2,dp2zero,ep2,pp2last1] [--calibrate round|once] [--threads 1]
        [--realtime] [--row-seconds 0] [--beside-held MIB]
    python -m benchmarks.predict_accuracy --pool LOG [LOG ...]    # the rounds of saved runs, judged together

For each case and layout: the ops a stage is made of are profiled with get_data at the layout's point,
TP and EP, in as many fresh processes as the layout runs (torchrun; ``python -m autotuner.main`` for one,
as a user profiles): on a CPU the ranks share the memory and the caches, and an op timed alone would run
faster than beside them, pipeline stages too (see profile(); a pipeline layout's round also predicts from
its stages' ops profiled in tp * dp processes and prints that beside). Every process, profiles, steps and
the calibration alike, runs one intra-op thread (``--threads``; 0: each process's share of the cores): on a
2-core VM a two-thread op waits for the slower of two virtual cores, and its rows move about twice as far
between profiles as one thread's (benchmarks.thread_noise). With ``--realtime`` every process runs at
real-time priority (benchmarks.machine_noise.run_realtime: on a 2-core VM gloo's collectives then stop
stalling for a scheduler tick); a run's first line says which
scheduling it had, and ``--pool`` judges the runs of each apart. Each
op is profiled with warm caches, each forward after the op's backward, and once flushed (the
predictor takes, for each visit of an op in the step, the kind it runs in:
autotuner.predict.caches.cache_plan); warm twice, first and last of the round's profiles, and the
predictor takes each op's mean of the two (a row times the machine in the second its samples took;
autotuner.predict.inputs.repeated). The device and the
links between two processes are calibrated in every round, between its first steps and its profiles (python -m
autotuner.calibrate, and collectives=true under torchrun: the Adam step's time per parameter, alone and
with both processes at it, the pipeline's transfers and the gradients' all-reduce, the caches a warm row
runs in, the memory bandwidth of modelled figures; ``--calibrate once``: once for the run, which shares
one calibration's error among all rounds, past what their spread shows). The predictor predicts the step
(autotuner.predict), and the real steps run (autotuner.predict.steps: the whole GPTModel, Megatron-Core's
schedule, Adam). Each round measures the steps, profiles, predicts and measures the steps again, afresh,
so the ratio's spread over rounds is printed beside its median; the measured step of a round is the mean
of its step draws (``--step-draws``, 4 by default): before its profiles, after them, and between them
(the machine's speed moves over minutes, and a step draw is seconds of it: draws through the round sample
it as the profiles did; the steps before and after alone are printed beside). With three
A/A controls: the measured step's IQR over its timed steps; over the rounds, the largest over the
smallest of the predicted step (each from fresh profiles: how far the op rows move between processes) and
of the measured step (each in fresh processes); and in each round the steps after over the steps before
(``drift``), with the median ratio of the rounds whose drift stayed within DRIFT_CALM ("calm rounds",
their count in brackets). Layouts: TP=1, TP=2 (torchrun, gloo), PP=2 (Megatron's 1F1B over gloo; with two
model chunks per rank, its interleaved schedule, for the 4-layer model) and DP=2 (the gradients
all-reduced after the backward; for the 4-layer model also with the distributed optimizer:
reduce-scattered, each rank's Adam on its half, the parameters all-gathered) for the dense models, DP=2
with EP=2 for the MoE one; on request (``--layouts pp2last1``) the 4-layer model's PP=2 split unevenly, 3
layers and the embedding on the first stage, 1 and the output layer on the last; 4 micro-batches per
data-parallel rank. Target: |ratio - 1| <= 0.05 for step time and peak memory, judged on the
median's 95% confidence interval over the rounds (order statistics, as the sampler's:
autotuner.measure.timer.median_ci, from 6 rounds): "met" when the interval lies inside [0.95, 1.05],
"missed" when it lies outside, "inconclusive" when it straddles an edge: on a machine whose own A/A
spread exceeds the target, a median of a few rounds can neither pass nor fail it. Under each case and
layout, alternatives side by side, each on the same rows and steps: the step's ratio had the rows been
added up by their medians, not their fenced means (the statistic's own share); on an interleaved layout,
the same prediction with each model chunk 1/v of its stage's time (the predictor gives each chunk its own
ops: autotuner.predict.timing.chunk_times); the same prediction with every stage's host work as timed
with warm caches (the predictor gives a stage whose ops sweep the shared cache the host work timed with it
flushed: autotuner.predict.caches.host_work_cached); the same prediction from the round's first warm
profile alone (the predictor takes each op's mean of its two warm rows: autotuner.predict.inputs.repeated);
the same rows with every op profiled in several processes taken from its slowest rank's row (the predictor
takes each rank's row of an op that waited for no other rank as a repeat:
autotuner.predict.inputs.ran_collectives); the same rows with a stage's first forward op from its flushed
row whatever its warm row timed (the predictor takes the warm row where that was timed after the op's
backward, as the visit runs: autotuner.predict.caches.warm_visits); the ops inside the forward-backward,
each hooked op's predicted time per visit / its time inside the measured steps
(autotuner.predict.in_step), medians over the rounds; then per rank the time between its ops in its
median step, per stage the host work of a micro-batch's forward predicted beside measured (the model
forwards' spans less their ops), and on a pipeline the hand-overs a stage waited for beside the predicted
exchange, and the measured step replayed through the predictor's schedule simulation over its measured
span (autotuner.predict.in_step.replay: the schedule model alone). With more than two step draws, the
same predictions judged on the first and the last draw alone; with
``--beside-row-seconds S``, the step predicted from the same ops profiled in the same round with rows
spanning S seconds (0: get_data's default), judged on the same draws, and its ratio to the round's own
prediction: what a row's span changes, the hour shared; with ``--beside-held MIB``, the step predicted from
one more warm profile, in the middle of the round, timed beside MIB of earlier calls' held activations
(``timing.held_activations_mib``) and the round's flushed one, beside the round's first warm profile's.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import statistics
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any, NamedTuple

from autotuner.measure.timer import median_ci
from autotuner.ops.naming import PHASES
from autotuner.predict.layout import Layout
from autotuner.predict.prediction import Runs, load_calibration_for, load_runs, predict
from autotuner.predict.schedule import simulate
from autotuner.predict.steps import run_process_group, run_steps
from autotuner.predict.validate import validate
from autotuner.results.calibration import ADAM_IN_STEP, HOST_WORK, HOST_WORK_FLUSHED
from autotuner.results.calibration import load as load_calibration
from autotuner.termination import unwinding_on_sigterm
from benchmarks.machine_noise import REALTIME_REFUSED, run_realtime

CASES = {
    "tiny": ["case=tiny"],
    # a llama-shaped model (Llama-2-7B's family) at reduced width and depth, seconds per step on a CPU
    "llama_small": [
        "case=llama7b",
        "hf.hidden_size=256",
        "hf.intermediate_size=688",
        "hf.num_attention_heads=4",
        "hf.num_key_value_heads=4",
        "hf.head_dim=64",
        "hf.num_hidden_layers=4",
        "hf.vocab_size=4096",
    ],
    "tiny_moe": ["case=tiny_moe"],  # Mixtral-shaped: 8 experts, top-2
}
SEQ, MBS, MICROBATCHES = 128, 1, 4
LAYOUTS = {
    "tp1": dict(tp=1),
    "tp2": dict(tp=2),
    "pp2": dict(pp=2),
    "vpp2": dict(pp=2, vpp=2),  # the interleaved schedule: two model chunks per rank
    "dp2": dict(dp=2),
    "dp2zero": dict(dp=2, distributed_optimizer=True),  # Megatron's distributed optimizer (ZeRO-1)
    "ep2": dict(dp=2, ep=2),
    # Megatron's uneven split: the last stage holds 1 layer besides the final norm and the output layer
    "pp2last1": dict(pp=2, last_stage_layers=1),
    "pp2first1": dict(pp=2, first_stage_layers=1),  # the other way: the first stage holds 1 layer
}
# Each case's layouts (--layouts picks among them): the dense models without EP, the MoE one with it.
DEFAULT = {
    "tiny": ("tp1", "tp2", "pp2", "dp2"),
    "llama_small": ("tp1", "tp2", "pp2", "vpp2", "dp2", "dp2zero"),  # 4 layers: 2 stages of 2 chunks
    "tiny_moe": ("ep2",),
}
# Layouts run only when --layouts names them (each case's own, beside DEFAULT's).
ON_REQUEST = {"llama_small": ("pp2last1", "pp2first1")}
# A round whose steps after the profiles ran within this fraction of the same steps before them.
DRIFT_CALM = 0.05
# The target: |predicted / measured - 1| within this.
TARGET = 0.05
# How many times a round measures its steps (--step-draws): before, between and after its profiles.
STEP_DRAWS = 4


def verdict(ratios: list[float]) -> tuple[str, tuple[float, float] | None]:
    """("met" | "missed" | "inconclusive" | "too few rounds", the median's 95% CI) of a layout's ratios over
    the rounds: the interval inside [1 - TARGET, 1 + TARGET], outside it, or across an edge."""
    ci = median_ci(sorted(ratios))
    if ci is None:
        return "too few rounds", None
    low, high = ci
    if 1 - TARGET <= low and high <= 1 + TARGET:
        return "met", ci
    if high < 1 - TARGET or low > 1 + TARGET:
        return "missed", ci
    return "inconclusive", ci


def round_line(index: int, rounds: int, name: str, layout_name: str, said: Round) -> str:
    """A round's line as it ends (:data:`ROUND_LINE` reads it back for ``--pool``)."""
    return (
        f"round {index}/{rounds} {name} {layout_name}: step predicted {said.predicted_s * 1e3:.1f} ms / "
        f"measured {said.measured_s * 1e3:.1f} = {said.step_ratio:.3f}, drift {said.drift:.3f}, memory "
        f"{said.memory_ratio:.3f}"
    )


def round_parts(said: Round) -> str:
    """Where a round's step went, predicted / measured: its phases, and stage 0's layer per visit (most
    of a step). The rounds' spread (the A/A columns) is traced to its parts by these."""
    phases = ", ".join(f"{phase} {p * 1e3:.4g}/{m * 1e3:.4g}" for phase, p, m in said.phases)
    layer = ", ".join(
        f"{what.split()[-1]} {p * 1e3:.3f}/{m * 1e3:.3f}"
        for stage, what, p, m, _ in said.in_step
        if stage == 0 and what.startswith("transformer_layer")
    )
    beside = (
        f"; from the other span's rows {said.beside_predicted_s / said.measured_s:.3f}"
        if said.beside_predicted_s
        else ""
    )
    if said.held_predicted_s and said.one_profile_predicted_s:
        beside += (
            f"; one warm profile held/measured {said.held_predicted_s / said.measured_s:.3f}, "
            f"unheld/measured {said.one_profile_predicted_s / said.measured_s:.3f}"
        )
    draws = ", ".join(f"{seconds * 1e3:.1f}" for seconds in said.step_draws_s or ())
    draws = f"; step draws (ms, in order): {draws}" if draws else ""
    return f"  ms, predicted/measured: {phases}; stage 0's layer per visit: {layer}{beside}{draws}"


# The run's scheduling line (a run's log opens with it; --pool judges runs of one scheduling together, a
# log without the line, from an older benchmark, ran with the default).
SCHEDULING = "scheduling"
DEFAULT_SCHEDULING = "the kernel's default"
REALTIME = "real-time (SCHED_FIFO, --realtime)"
ROUND_LINE = re.compile(
    r"^round \d+/\d+ (?P<case>\S+) (?P<layout>\S+): step predicted [\d.]+ ms / measured [\d.]+ = "
    r"(?P<step>[\d.]+), drift (?P<drift>[\d.]+), memory (?P<memory>[\d.]+)$"
)


def pooled(logs: list[Path]) -> int:
    """The verdicts over the rounds of several runs' logs pooled per case, layout and scheduling (a run's
    ``--realtime`` or not, from its log's first line): rounds are
    independent (each profiles, calibrates with ``--calibrate round``, and measures afresh), so two runs
    of 6 rounds judge as one of 12, whose interval leaves out the extremes that 6 rounds' interval cannot
    (it is their min and max)."""
    unreadable = [str(log) for log in logs if not log.is_file()]
    if unreadable:
        print(
            f"no such log: {', '.join(unreadable)} (give the files a run's output was saved to)",
            file=sys.stderr,
        )
        return 2
    found: dict[tuple[str, str, str], dict[str, list[float]]] = {}
    for log in logs:
        scheduling = DEFAULT_SCHEDULING
        for line in log.read_text().splitlines():
            if line.startswith(f"{SCHEDULING}: "):
                scheduling = line.split(": ", 1)[1]
            if match := ROUND_LINE.match(line.strip()):
                ratios = found.setdefault(
                    (match["case"], match["layout"], scheduling), {"step": [], "memory": [], "drift": []}
                )
                for what in ratios:
                    ratios[what].append(float(match[what]))
    if not found:
        print(f"no round lines in {', '.join(map(str, logs))}", file=sys.stderr)
        return 2
    for (name, layout_name, scheduling), ratios in found.items():
        said = []
        for what in ("step", "memory"):
            judged, ci = verdict(ratios[what])
            median = statistics.median(ratios[what])
            said.append(
                f"{what} {median:.3f} {judged}" + (f" (95% CI [{ci[0]:.3f}, {ci[1]:.3f}])" if ci else "")
            )
        calm = [r for r, d in zip(ratios["step"], ratios["drift"], strict=True) if abs(d - 1) <= DRIFT_CALM]
        calm_said = f"{statistics.median(calm):.3f} ({len(calm)})" if calm else "none"
        print(
            f"{name:12} {layout_name:7} {len(ratios['step'])} rounds: {'; '.join(said)}; "
            f"calm rounds' step {calm_said}; scheduling {scheduling}"
        )
    return 0


# What a stage is made of (autotuner.predict.timing): each measured whole, at the layout's point.
STAGE_OPS = ("embedding", "transformer_layer", "final_layernorm", "output_layer")


def _run_whole(command: list[str], timeout_s: float, env: dict[str, str] | None = None) -> None:
    """``command`` with its output captured, every process it starts stopped with it if this run stops
    (autotuner.predict.steps.run_process_group: a stopped benchmark left torchrun's workers running
    into its next round's steps); CalledProcessError if it fails."""
    run_process_group(command, env, timeout_s).check_returncode()


def cpu_share(processes: int, threads: int = 0) -> list[str]:
    """Each process's intra-op threads, the same in the profile and in the steps: ``threads``, or (0) the
    process's share of the cores (a TP=2 or PP=2 step runs two processes on this machine's cores, so ops
    profiled with all of them would be too fast)."""
    return [f"timing.threads={threads or max(1, len(os.sched_getaffinity(0)) // processes)}"]


def threads_per_process(text: str) -> int:
    """--threads: a whole number, 0 for the cores' share."""
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r}: give a whole number of threads (0: the cores' share)")
    return int(text)


def profile_processes(layout: Layout, alone: bool = False) -> int:
    """How many processes profile the layout's ops: every process it runs (``alone``: those that run one op
    together, tp * dp)."""
    # every process the layout runs: on a CPU the layout's "GPUs" are processes of one host, which share
    # its memory and its L3, so an op timed alone runs faster than beside them. Pipeline stages too, though
    # they run their ops staggered: inside PP2 steps a stage's visits while the other stage sat between
    # its ops ran no faster than those it overlapped: what slows them is the other process
    # on the host (most likely its data through the shared cache), not two ops at one moment; a profile in
    # one process read the llama-shaped PP2's layers at 0.85-1.00 of their time inside the steps, one in
    # two processes at 1.01-1.11 (this benchmark's alone_predicted_s line prints both)
    return layout.gpus // layout.pp if alone else layout.gpus


def profile(
    case: list[str],
    layout: Layout,
    run_dir: Path,
    calibration: Path,
    flush: bool,
    threads: int = 0,
    alone: bool = False,
    after_backward: bool = True,
    row_seconds: float = 0.0,
    held_activations_mib: float = 0.0,
) -> None:
    """The stage's ops at the layout's point, TP and EP, each process on ``threads`` (:func:`cpu_share`),
    in :func:`profile_processes` processes; warm, each forward sample after the op's backward
    (``after_backward``, as the predictor's profiling plan asks: autotuner.predict.plan) or back to back;
    each row's samples spanning at least ``row_seconds`` (``timing.min_time_s``; 0: get_data's default);
    warm ones beside ``held_activations_mib`` of earlier calls' held activations (0: none)."""
    argv = [
        *case,
        *cpu_share(layout.gpus, threads),
        "device=cpu",
        f"ops=[{','.join(STAGE_OPS)}]",
        f"timing.flush_cache={str(flush).lower()}",
        f"timing.forward_after_backward={str(after_backward and not flush).lower()}",
        f"shapes.seq_len=[{SEQ}]",
        f"shapes.micro_batch_size=[{MBS}]",
        "progress=false",
        "report=false",
        f"calibration={calibration}",
        f"hydra.run.dir={run_dir}",
        f"timing.min_time_s={row_seconds}",
        *(
            [f"timing.held_activations_mib={held_activations_mib:g}"]
            if held_activations_mib and not flush
            else []
        ),
    ]
    world = profile_processes(layout, alone)
    # One process too is a fresh one, as a user profiles and as the steps run, not this long-lived process,
    # whose state (its heap, Hydra's and Megatron's globals) would carry from profile to profile and round
    # to round, so every round's rows would share one process's draw of it. Profiled in this process the
    # rows predicted 0.984 [0.819, 1.044] of the fresh processes' step (14 paired rounds): no difference
    # beyond the rounds' spread, and with fresh processes the rounds are independent draws
    if world == 1:
        command = [sys.executable, "-m", "autotuner.main", *argv]
    else:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}"]
        command += ["-m", "autotuner.main", *argv, f"tf.tensor_model_parallel_size={layout.tp}"]
        command += [f"tf.expert_model_parallel_size={layout.ep}"] if layout.ep > 1 else []
    _run_whole(command, timeout_s=900)


def layout_of(name: str) -> Layout:
    """LAYOUTS[name] at the benchmark's point: s SEQ, MBS per micro-batch, MICROBATCHES per DP rank."""
    parallel = LAYOUTS[name]
    dp = parallel.get("dp", 1)
    return Layout(
        seq_len=SEQ, micro_batch_size=MBS, global_batch_size=MBS * MICROBATCHES * dp, dtype="fp32", **parallel
    )


def steps_arguments(case: list[str], layout: Layout, threads: int = 0) -> tuple[str, list[str]]:
    """The case and overrides of the layout's real steps (autotuner.predict.steps), each process on
    ``threads`` (:func:`cpu_share`)."""
    return case[0].split("=", 1)[1], [*case[1:], *cpu_share(layout.gpus, threads), "device=cpu"]


def profile_dir(folder: Path, mode: str, alone: bool = False) -> Path:
    """Where a round's profile of one kind (``warm``, ``cold``, ...) goes under ``folder``."""
    return folder / f"{'alone-' if alone else ''}{mode}"


def profiled_runs(
    case: list[str],
    layout: Layout,
    folder: Path,
    calibration: Path,
    threads: int = 0,
    alone: bool = False,
    row_seconds: float = 0.0,
) -> Runs:
    """The stage's ops profiled warm and flushed (:func:`profile`) under ``folder``, loaded as the
    predictor reads them (benchmarks.layout_ranking's profiles; a round here orders its own profiles
    among its step draws: :func:`one_round`)."""
    run_dirs = [profile_dir(folder, mode, alone) for mode in ("warm", "cold")]
    for run_dir in run_dirs:
        cold = run_dir.name.endswith("cold")
        profile(case, layout, run_dir, calibration, cold, threads, alone, row_seconds=row_seconds)
    return load_runs(run_dirs)


def calibrate_machine(calibration: Path, threads: int = 0) -> str:
    """Calibrate the device and the links between two processes (gloo) into ``calibration``: the ceilings,
    the Adam step alone and with both processes at it, the pipeline's transfers, the collectives (the
    device's on ``threads`` intra-op threads, as the steps run; 0: torch's default). Returns a line of
    what the predicted steps depend on most."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)} if threads else None
    device = [sys.executable, "-m", "autotuner.calibrate", "device=cpu", f"out={calibration}"]
    _run_whole(device, timeout_s=600, env=env)
    links = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    links += ["-m", "autotuner.calibrate", "device=cpu", "collectives=true", f"out={calibration}"]
    _run_whole(links, timeout_s=600)
    cal = load_calibration(calibration)
    return (
        f"copy {cal['memory_bandwidth'] / 1e9:.1f} GB/s, Adam {cal['adam_seconds_per_parameter'] * 1e9:.2f} "
        f"ns/parameter + {cal['adam_seconds_per_tensor'] * 1e6:.1f} us/tensor + "
        f"{cal.get(ADAM_IN_STEP, 0.0) * 1e3:.2f} ms a step inside training steps (two processes at once: "
        f"{cal['adam_seconds_per_parameter_together']['gloo:2'] * 1e9:.2f}), send_recv (gloo:2) "
        f"{cal['send_recv_bandwidth']['gloo:2'] / 1e9:.2f} GB/s"
    )


class Round(NamedTuple):
    """What one round of a case and layout gives."""

    step_ratio: float  # predicted step / the bracket of the measured steps
    memory_ratio: float  # predicted peak / measured peak
    step_noise: float  # the measured steps' IQR / median
    predicted_s: float
    measured_s: float  # the mean of the round's step draws: before, between and after the profiles
    phases: tuple[tuple[str, float, float], ...]  # (phase, predicted s, measured s)
    drift: float  # the steps after the profiles / before them
    in_step: tuple[tuple[int, str, float, float, str], ...]  # autotuner.predict.validate.Validation.in_step
    adam_rate: float  # the round's calibrated Adam seconds per parameter
    adam_in_training_s: float  # and its time once a step inside training steps beyond its rates (0: none)
    between_ops: tuple[tuple[int, float, float], ...]  # per rank: (rank, between ops s, forward-backward s)
    handovers: tuple[float, ...]  # a 1F1B pipeline's hand-overs a stage waited for, s
    predicted_transfer_s: float | None  # the predictor's pp_p2p per exchange
    replay: float | None  # the schedule model on the measured forwards and backwards / their measured span
    # the same rows added up by their medians, not the fenced means the predictor adds up
    # (autotuner.measure.stats): the statistic's share of the ratio, judged on the same rows and steps
    medians_predicted_s: float
    # a pipeline layout's step predicted from its stage's ops profiled in as many processes as run one op
    # together (tp * dp) (None: no pipeline, no change)
    alone_predicted_s: float | None
    # an interleaved layout's step from the same rows with each model chunk 1/v of its stage and the host
    # work's stage part once per stage, not per chunk as the predictor places them (None: no vpp)
    even_chunks_predicted_s: float | None = None
    # per rank: (its pipeline stage, the predicted host work of a micro-batch's forward, the measured one:
    # the model forwards' spans less the ops inside them, autotuner.predict.in_step.host_work_s), s; the
    # backward's part is not beside it: on a pipeline it holds the waits for the other stage
    host_forward: tuple[tuple[int, float, float], ...] = ()
    # the step from the same rows with the host work as timed with warm caches whatever the stage's ops
    # sweep (None: no host work flushed in the calibration)
    warm_host_predicted_s: float | None = None
    # the step from the round's first warm profile alone (and its flushed rows): the warm rows of one moment
    # in the round
    one_profile_predicted_s: float | None = None
    # the step from the same rows with a stage's first forward op taking its flushed row whatever its warm
    # row timed (the predictor's rule: autotuner.predict.caches.warm_visits)
    first_forward_flushed_predicted_s: float | None = None
    # the step from rows of the other span (--beside-row-seconds), profiled in the same round around its
    # own profiles (warm, flushed, warm again), judged on the same steps (None: not asked)
    beside_predicted_s: float | None = None
    # the step from one warm profile timed beside held activations (--beside-held) and the round's flushed
    # one, to set beside one_profile_predicted_s (the round's first warm profile and the same flushed one)
    held_predicted_s: float | None = None
    # the step draws in the order they ran, s: the first before the profiles, the last after them
    step_draws_s: tuple[float, ...] = ()
    # the step from the same rows with every op profiled in several processes taking its slowest rank's
    # row (the predictor takes the ranks' rows of an op that waited for no other rank as repeats:
    # autotuner.predict.inputs.ran_collectives; None: one process profiled)
    slowest_rank_predicted_s: float | None = None


def even_chunks_step_s(pred: Any, calibrated: dict[str, Any]) -> float:
    """``pred``'s step with its interleaved pipeline placed evenly:
    each model chunk 1/v of its stage's time, the host work's part for a stage paid once per stage, not
    per chunk (autotuner.predict.timing.chunk_times)."""
    lay, step = pred.layout, pred.step
    work = calibrated.get(HOST_WORK) or {}
    own = {
        (st.index, phase): (getattr(st, phase) - (lay.vpp - 1) * work.get(phase, 0.0)) / lay.vpp
        for st in pred.stages
        for phase in PHASES
    }
    sched = simulate(
        lambda key: own[key[:2]],
        lay.pp,
        lay.vpp,
        lay.microbatches,
        step.schedule.exchange_s,
        step.exchange_overlapped,
    )
    return sched.end + step.dp_reduction + step.optimizer


def one_round(
    name: str,
    layout_name: str,
    repeats: int,
    calibration: Path | None,
    threads: int,
    row_seconds: float = 0.0,
    beside_row_seconds: float | None = None,
    step_draws: int = STEP_DRAWS,
    beside_held_mib: float = 0.0,
) -> Round:
    """One round of a case and layout; ``calibration`` None: the round calibrates the machine itself;
    ``row_seconds``: each profiled row's least span (:func:`profile`); ``beside_row_seconds``: the same
    ops profiled again with rows of that span, each of their three profiles just outside the same kind of
    the round's own (first warm before the first, flushed after the flushed, warm again after the warm
    again: both kinds' warm pairs bracket the middle of the round), predicted from alone and judged on
    the same steps (:attr:`Round.beside_predicted_s`); ``step_draws``: how many times the steps are
    measured, first before the profiles, last after them (the validation), the rest spread between
    them (:func:`draw_points`); ``beside_held_mib``: one more warm profile, in the middle of the round,
    timed beside that many MiB of earlier calls' held activations (``timing.held_activations_mib``),
    predicted with the round's flushed one (:attr:`Round.held_predicted_s`)."""
    case, layout = CASES[name], layout_of(layout_name)
    steps_args = steps_arguments(case, layout, threads)
    with tempfile.TemporaryDirectory(prefix="predict-accuracy-") as folder:
        where = Path(folder)
        draws = [run_steps(*steps_args, layout, where / "steps-0.json", repeats=repeats).step_s]
        if calibration is None:
            # the machine as the profiles find it: one calibration shared by every round would bias them
            # all alike, past any interval
            calibration = where / "calibration.json"
            calibrate_machine(calibration, threads)
        own = [profile_dir(where, mode) for mode in ("warm", "cold")]
        # the warm rows again, last of the round's own profiles: with the first, they bracket the round as
        # the step draws do, and the predictor takes each op's mean of the two (autotuner.predict.inputs.
        # repeated: a row times the machine in the second its samples took)
        again = profile_dir(where, "warm-again")
        # a pipeline's stage ops also profiled in as many processes as run one op together: the same
        # round's steps judge the two ways of profiling a pipeline's stages
        alone = [profile_dir(where, mode, alone=True) for mode in ("warm", "cold")] if layout.pp > 1 else []
        asked = beside_row_seconds is not None
        beside = (
            [profile_dir(where, f"beside-{mode}") for mode in ("warm", "cold", "warm-again")] if asked else []
        )
        held = [profile_dir(where, "held")] if beside_held_mib else []
        order = [*beside[:1], *own, *beside[1:2], *alone, *held, again, *beside[2:]]
        draws_after = draw_points(len(order), step_draws)
        for done in range(len(order) + 1):  # ``done`` profiles run so far
            for _ in range(draws_after.count(done)):
                out = where / f"steps-{len(draws)}.json"
                draws.append(run_steps(*steps_args, layout, out, repeats=repeats).step_s)
            if done < len(order):
                run_dir = order[done]
                span = beside_row_seconds if run_dir in beside else row_seconds
                flush = run_dir.name.endswith("cold")
                profile(
                    case,
                    layout,
                    run_dir,
                    calibration,
                    flush,
                    threads,
                    run_dir in alone,
                    row_seconds=span,
                    held_activations_mib=beside_held_mib if run_dir in held else 0.0,
                )
        first = load_runs(own)
        calibrated = load_calibration_for(first, str(calibration))  # read and checked once, for all
        alone_predicted = predict(load_runs(alone), layout, calibrated).step_seconds if alone else None
        beside_predicted = predict(load_runs(beside), layout, calibrated).step_seconds if asked else None
        runs = load_runs([*own, again])
        pred = predict(runs, layout, calibrated)
        one_profile = predict(first, layout, calibrated).step_seconds
        held_predicted = (
            predict(load_runs([*held, own[1]]), layout, calibrated).step_seconds if held else None
        )
        medians = [{k: v for k, v in row.items() if k != "fenced_mean_us"} for row in runs.rows]
        medians_predicted = predict(dataclasses.replace(runs, rows=medians), layout, calibrated).step_seconds
        even_chunks = even_chunks_step_s(pred, calibrated) if layout.vpp > 1 else None
        warm_host = warm_host_work_step_s(runs, layout, calibrated)
        unmarked = [{**row, "forward_after_backward": False} for row in runs.rows]
        first_flushed = predict(dataclasses.replace(runs, rows=unmarked), layout, calibrated).step_seconds
        # a multi-process run's merged rows alone: each op its slowest rank's row
        merged = [r for r in runs.rows if r.get("run_processes", 1) == 1 or r.get("rank") == "max"]
        slowest = dataclasses.replace(runs, rows=merged)
        slowest_rank = predict(slowest, layout, calibrated).step_seconds if layout.gpus > 1 else None
        checked = validate(pred, *steps_args, repeats=repeats)
    draws.append(checked.measured_step_s)
    # the machine's speed over the round, as the profiles sampled it: the mean of the step draws through it
    measured = statistics.fmean(draws)
    return Round(
        step_ratio=checked.predicted_step_s / measured,
        memory_ratio=checked.memory_error + 1,
        step_noise=checked.measured_step_iqr_s / checked.measured_step_s,
        predicted_s=checked.predicted_step_s,
        measured_s=measured,
        phases=checked.phases,
        drift=draws[-1] / draws[0],
        in_step=checked.in_step,
        adam_rate=calibrated["adam_seconds_per_parameter"],
        adam_in_training_s=calibrated.get(ADAM_IN_STEP, 0.0),
        between_ops=tuple((r.rank, r.between_ops_s, r.forward_backward_s) for r in checked.timeline),
        handovers=tuple(seconds for _, seconds in checked.handovers),
        predicted_transfer_s=checked.predicted_transfer_s,
        replay=checked.replayed_s / checked.measured_span_s
        if checked.replayed_s and checked.measured_span_s
        else None,
        medians_predicted_s=medians_predicted,
        alone_predicted_s=alone_predicted,
        even_chunks_predicted_s=even_chunks,
        host_forward=forward_host_work(pred, checked),
        warm_host_predicted_s=warm_host,
        one_profile_predicted_s=one_profile,
        first_forward_flushed_predicted_s=first_flushed,
        beside_predicted_s=beside_predicted,
        held_predicted_s=held_predicted,
        step_draws_s=tuple(draws),
        slowest_rank_predicted_s=slowest_rank,
    )


def draw_points(profiles: int, step_draws: int) -> list[int]:
    """After how many of a round's ``profiles`` (in the order they run) each step draw between the first
    and the last runs, for ``step_draws`` draws in all: the first runs before every profile and the last
    after them all, the rest as evenly between them as whole profiles allow (a point twice: two draws
    there; 0: before the first profile, after the round's calibration)."""
    return [round(k * profiles / (step_draws - 1)) for k in range(1, step_draws - 1)]


def warm_host_work_step_s(runs: Runs, layout: Layout, calibrated: dict[str, Any]) -> float | None:
    """The step predicted from ``runs`` with every stage's host work as timed with warm caches (the
    calibration less its flushed figure: autotuner.predict.caches.host_work_cached), as before session
    28; None where the calibration has no flushed figure."""
    if HOST_WORK_FLUSHED not in calibrated:
        return None
    warm_only = {k: v for k, v in calibrated.items() if k != HOST_WORK_FLUSHED}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return predict(runs, layout, warm_only).step_seconds


def forward_host_work(pred: Any, checked: Any) -> tuple[tuple[int, float, float], ...]:
    """:attr:`Round.host_forward` of a round's prediction and its validated steps (none on a GPU)."""
    from autotuner.predict.in_step import host_work_s

    predicted = {
        st.index: sum(
            t.seconds for name, phase, t, _ in st.items if name == "host_work" and phase == "forward"
        )
        for st in pred.stages
    }
    return tuple(
        (
            r.pp_rank,
            predicted[r.pp_rank],
            host_work_s(r.visits, r.forward_backward_s, pred.layout.microbatches)[0],
        )
        for r in checked.timeline
        if predicted.get(r.pp_rank)
    )


def print_pairs(label: str, who: str, between: str, entries: list[tuple[int, float, float]]) -> None:
    """One line of ``(rank or stage, seconds, seconds)`` entries over the rounds: per key the two medians,
    in ms (nothing where there are none)."""
    by_key: dict[int, list[tuple[float, float]]] = {}
    for key, first, second in entries:
        by_key.setdefault(key, []).append((first, second))
    if by_key:
        print(
            f"{'':21} {label}: "
            + ", ".join(
                f"{who} {key} {statistics.median(a for a, _ in v) * 1e3:.3g} {between} "
                f"{statistics.median(b for _, b in v) * 1e3:.3g}"
                for key, v in sorted(by_key.items())
            )
        )


@unwinding_on_sigterm()  # a SIGTERM removes the temporary folders of steps and profiles, then ends
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7, help="timed steps per measurement")
    parser.add_argument(
        "--rounds", type=int, default=6, help="profile + predict + measure, this many times (6 for a verdict)"
    )
    parser.add_argument("--cases", default=",".join(CASES), help=f"of {', '.join(CASES)}")
    parser.add_argument(
        "--layouts", help=f"only these of each case's layouts: {DEFAULT}, and on request {ON_REQUEST}"
    )
    parser.add_argument(
        "--calibrate",
        choices=("round", "once"),
        default="round",
        help="calibrate the machine in every round (default) or once for the run",
    )
    parser.add_argument(
        "--threads",
        type=threads_per_process,
        default=1,
        help="intra-op threads of every process, profiles, steps and calibration alike (default 1: see "
        "the module docstring); 0: each process's share of the cores",
    )
    parser.add_argument(
        "--realtime",
        action="store_true",
        help="run everything (profiles, calibration, steps) at real-time priority, as SCHED_FIFO's lowest "
        "level: a CPU VM's collectives then stop stalling for a scheduler tick (benchmarks.machine_noise)",
    )
    parser.add_argument(
        "--row-seconds",
        type=float,
        default=0.0,
        help="each profiled row's samples span at least this long (timing.min_time_s; default 0: get_data's "
        "default sampling, about a second a row): on a VM whose speed moves second to second, a second is "
        "one draw of it (autotuner.measure.timer)",
    )
    parser.add_argument(
        "--step-draws",
        type=int,
        default=STEP_DRAWS,
        help=f"measure each round's steps this many times (default {STEP_DRAWS}): before its profiles, after "
        "them, the rest spread between them; the round's measured step is their mean (2: before and after "
        "alone)",
    )
    parser.add_argument(
        "--beside-row-seconds",
        type=float,
        metavar="SECONDS",
        help="also profile each round's ops with rows spanning this long (0: get_data's default), around "
        "the round's own profiles, and judge their prediction on the same steps: the two spans compared "
        "round by round, the machine's hour shared",
    )
    parser.add_argument(
        "--beside-held",
        type=float,
        default=0.0,
        metavar="MIB",
        help="also profile each round's ops warm beside this many MiB of held activations "
        "(timing.held_activations_mib), in the middle of the round, and judge their prediction (with the "
        "round's flushed profile) on the same steps, beside the round's first warm profile's",
    )
    parser.add_argument(
        "--pool",
        nargs="+",
        type=Path,
        metavar="LOG",
        help="run nothing: judge the rounds of these runs' saved output (stdout and stderr) pooled",
    )
    args = parser.parse_args()
    for flag, seconds in (
        ("--row-seconds", args.row_seconds),
        ("--beside-row-seconds", args.beside_row_seconds),
    ):
        if seconds is not None and seconds < 0:
            parser.error(f"{flag} {seconds:g}: give 0 or more seconds")
    if args.beside_held < 0:
        parser.error(f"--beside-held {args.beside_held:g}: give 0 or more MiB")
    if args.step_draws < 2:
        parser.error(f"--step-draws {args.step_draws}: give 2 or more (before and after the profiles)")
    if args.pool:
        return pooled(args.pool)
    if args.realtime:
        try:
            run_realtime()  # inherited by every process and thread started from here on
        except PermissionError:
            parser.error(f"--realtime: {REALTIME_REFUSED}")
    print(f"{SCHEDULING}: {REALTIME if args.realtime else DEFAULT_SCHEDULING}")
    threads = args.threads or "each process's share of the cores"
    print(f"intra-op threads per process (profiles, steps, calibration): {threads}")
    print(f"each profiled row's samples span at least: {args.row_seconds:g} s (timing.min_time_s)")
    if args.beside_row_seconds is not None:
        print(f"beside them, in the same rounds, rows spanning at least: {args.beside_row_seconds:g} s")
    with tempfile.TemporaryDirectory(prefix="predict-accuracy-cal-") as folder:
        calibration = Path(folder) / "calibration.json" if args.calibrate == "once" else None
        if calibration is not None:
            print(f"calibration, once for the run: {calibrate_machine(calibration, args.threads)}")
        else:
            print("calibration: afresh in every round, inside its bracket (the Adam rates below each layout)")
        header = (
            "case",
            "layout",
            "step pred/meas",
            "memory pred/meas",
            "step IQR/median",
            "A/A pred",
            "A/A meas",
            "drift",
            "calm rounds",
            "phases pred/meas ms: fwd-bwd, DP comm, Adam",
        )
        print(
            f"{header[0]:12} {header[1]:7} {header[2]:>22} {header[3]:>22} {header[4]:>16} {header[5]:>9} "
            f"{header[6]:>9} {header[7]:>13} {header[8]:>14}  {header[9]}"
        )
        worst = 0.0
        verdicts: dict[str, dict[str, list[str]]] = {"step": {}, "memory": {}}
        for name in args.cases.split(","):
            own = (*DEFAULT[name], *ON_REQUEST.get(name, ()))
            chosen = [n for n in own if n in args.layouts.split(",")] if args.layouts else DEFAULT[name]
            for layout_name in chosen:
                results = []
                for index in range(args.rounds):
                    results.append(
                        one_round(
                            name,
                            layout_name,
                            args.repeats,
                            calibration,
                            args.threads,
                            args.row_seconds,
                            args.beside_row_seconds,
                            args.step_draws,
                            args.beside_held,
                        )
                    )
                    said = results[-1]
                    print(  # each round as it ends (on stderr, beside the table): a long run's progress
                        round_line(index + 1, args.rounds, name, layout_name, said),
                        round_parts(said),
                        sep="\n",
                        file=sys.stderr,
                        flush=True,
                    )
                step = [r.step_ratio for r in results]
                memory = [r.memory_ratio for r in results]
                noise = statistics.median(r.step_noise for r in results)
                # A/A: the same prediction (fresh profiles) and the same steps (fresh processes) repeated,
                # largest over smallest: how far a ratio can move with nothing changed
                aa_pred, aa_meas = (
                    max(values) / min(values)
                    for values in ([r.predicted_s for r in results], [r.measured_s for r in results])
                )
                worst = max(worst, abs(statistics.median(step) - 1), abs(statistics.median(memory) - 1))
                spread = [f"{statistics.median(v):8.3f} [{min(v):.3f}, {max(v):.3f}]" for v in (step, memory)]
                # where a step's error comes from: each phase's predicted and measured time (medians)
                phases = ", ".join(
                    f"{statistics.median(r.phases[i][1] for r in results) * 1e3:.3g}/"
                    f"{statistics.median(r.phases[i][2] for r in results) * 1e3:.3g}"
                    for i in range(len(results[0].phases))
                )
                # the same steps after the profiles over before them, each round: how far the machine
                # moved while the round ran; the rounds within DRIFT_CALM of 1 judge the step alone
                drift = [r.drift for r in results]
                calm = [r.step_ratio for r in results if abs(r.drift - 1) <= DRIFT_CALM]
                calm_said = f"{statistics.median(calm):.3f} ({len(calm)})" if calm else "none"
                print(
                    f"{name:12} {layout_name:7} {spread[0]:>22} {spread[1]:>22} {noise:16.3f} {aa_pred:9.3f} "
                    f"{aa_meas:9.3f} {min(drift):6.3f}-{max(drift):.3f} {calm_said:>14}  {phases}"
                )
                together = profile_processes(layout_of(layout_name), alone=True)
                for label, predicted_of in (
                    (
                        "the same rows added up by their medians, not their fenced means",
                        lambda r: r.medians_predicted_s,
                    ),
                    (
                        f"the stage's ops profiled in {together} process{'es' if together > 1 else ''} "
                        "(those running one op together)",
                        lambda r: r.alone_predicted_s,
                    ),
                    (
                        "each model chunk 1/v of its stage, host work once a stage",
                        lambda r: r.even_chunks_predicted_s,
                    ),
                    (
                        "the host work as timed with warm caches, whatever the stage's ops sweep",
                        lambda r: r.warm_host_predicted_s,
                    ),
                    (
                        "the warm rows of the round's first profile alone, not the mean of two bracketing "
                        "the round",
                        lambda r: r.one_profile_predicted_s,
                    ),
                    (
                        "a stage's first forward op from its flushed row, whatever its warm row timed",
                        lambda r: r.first_forward_flushed_predicted_s,
                    ),
                    (
                        "every op profiled in several processes from its slowest rank's row",
                        lambda r: r.slowest_rank_predicted_s,
                    ),
                    (
                        (
                            f"rows spanning at least {args.beside_row_seconds:g} s"
                            if args.beside_row_seconds
                            else "rows of get_data's default span (about a second)"
                        )
                        + " (--beside-row-seconds), profiled around the round's own",
                        lambda r: r.beside_predicted_s,
                    ),
                    (
                        f"one warm profile timed beside {args.beside_held:g} MiB of held activations "
                        "(--beside-held) with the round's flushed one",
                        lambda r: r.held_predicted_s,
                    ),
                ):
                    beside = [predicted_of(r) / r.measured_s for r in results if predicted_of(r)]
                    if beside:
                        predicted = [predicted_of(r) for r in results if predicted_of(r)]
                        print(
                            f"{'':21} {label}: step {statistics.median(beside):.3f} "
                            f"[{min(beside):.3f}, {max(beside):.3f}], "
                            f"A/A pred {max(predicted) / min(predicted):.3f}"
                        )
                if args.step_draws > 2:
                    # the same predictions judged on the two ends' draws alone: what the draws between buy
                    measured_ends = [(r.step_draws_s[0] + r.step_draws_s[-1]) / 2 for r in results]
                    ends = [r.predicted_s / m for r, m in zip(results, measured_ends, strict=True)]
                    print(
                        f"{'':21} measured by the steps before and after the profiles alone, not "
                        f"{args.step_draws} draws through the round: step "
                        f"{statistics.median(ends):.3f} [{min(ends):.3f}, {max(ends):.3f}], A/A meas "
                        f"{max(measured_ends) / min(measured_ends):.3f}"
                    )
                if args.beside_row_seconds is not None:
                    # the two spans' predictions of one round share its steps and its hour: their ratio
                    # round by round is the span's own effect, and each kind's verdict on the same steps
                    paired = [r.beside_predicted_s / r.predicted_s for r in results]
                    judged, ci = verdict([r.beside_predicted_s / r.measured_s for r in results])
                    print(
                        f"{'':21} the other span's prediction / the round's own: "
                        f"{statistics.median(paired):.3f} [{min(paired):.3f}, {max(paired):.3f}]; its step "
                        f"{judged}" + (f" (95% CI [{ci[0]:.3f}, {ci[1]:.3f}])" if ci else "")
                    )
                # inside the forward-backward: each hooked op per visit, predicted/measured (medians)
                inside = {}
                for r in results:
                    for stage, what, predicted, measured, _ in r.in_step:
                        inside.setdefault((stage, what), []).append((predicted, measured))
                for (stage, what), pairs in inside.items():
                    pred_ms = statistics.median(p for p, _ in pairs) * 1e3
                    meas_ms = statistics.median(m for _, m in pairs) * 1e3
                    ratio = pred_ms / meas_ms
                    print(f"{'':21} stage {stage} {what:27} {pred_ms:8.3f} / {meas_ms:8.3f} ms  {ratio:6.3f}")
                # the time between a rank's ops in its median step: waits, transfers, the schedule
                print_pairs(
                    "between the ops (ms of the forward-backward, medians)",
                    "rank",
                    "of",
                    [entry for r in results for entry in r.between_ops],
                )
                print_pairs(
                    "host work of a micro-batch's forward (ms, predicted / measured, medians)",
                    "stage",
                    "/",
                    [entry for r in results for entry in r.host_forward],
                )
                handed = [s for r in results for s in r.handovers]
                if handed:
                    transfer = statistics.median(r.predicted_transfer_s or 0.0 for r in results)
                    median = statistics.median(handed)
                    print(
                        f"{'':21} hand-overs a stage waited for: median {median * 1e3:.3g} ms "
                        f"over {len(handed)} [{min(handed) * 1e3:.3g}, {max(handed) * 1e3:.3g}]; predicted "
                        f"exchange {transfer * 1e3:.3g} ms"
                    )
                replays = [r.replay for r in results if r.replay is not None]
                if replays:
                    print(
                        f"{'':21} the schedule model on the measured forwards, backwards and hand-overs / "
                        f"the measured span: {statistics.median(replays):.3f} "
                        f"[{min(replays):.3f}, {max(replays):.3f}]"
                    )
                if args.calibrate == "round":
                    adam = [r.adam_rate * 1e9 for r in results]
                    once = [r.adam_in_training_s * 1e3 for r in results]
                    print(
                        f"{'':21} Adam in the rounds' calibrations: {min(adam):.2f}-{max(adam):.2f} ns a "
                        f"parameter, + {min(once):.2f}-{max(once):.2f} ms a step inside training steps"
                    )
                said = []
                for what, ratios in (("step", step), ("memory", memory)):
                    judged, ci = verdict(ratios)
                    verdicts[what].setdefault(judged, []).append(f"{name} {layout_name}")
                    said.append(f"{what} {judged}" + (f" (95% CI [{ci[0]:.3f}, {ci[1]:.3f}])" if ci else ""))
                print(f"{'':21} target |ratio - 1| <= {TARGET}: {'; '.join(said)}")
        print(f"worst |median ratio - 1|: {worst:.3f}")
        for what, judged in verdicts.items():
            print(
                f"{what}: "
                + "; ".join(f"{k} in {len(v)} ({', '.join(v)})" for k, v in sorted(judged.items()))
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
