"""Measured training steps (autotuner.validate.steps): the whole GPTModel trained for real, timed and metered,
single-process and under torchrun with TP=2, DP=2, PP=2 (Megatron's own 1F1B schedule over gloo), PP=2 with
two model chunks per rank (its interleaved schedule) and, for the MoE model, EP=2."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from autotuner.errors import UserError
from autotuner.predict.layout import Layout
from autotuner.validate.in_step import IN_STEP_KEYS, inside_ops_s
from autotuner.validate.step_measurement import RankSteps, StepMeasurement
from autotuner.validate.steps import measure_steps, run_process_group, run_steps
from benchmarks.predict_accuracy import CASES

# Four micro-batches of one 16-token sequence: the schedules accumulate over several of them.
BATCH = {"seq_len": 16, "micro_batch_size": 1, "global_batch_size": 4, "dtype": "fp32"}
CPU = ["device=cpu"]
WATCHDOG_S = 300  # a deadlocked pipeline ends here, not at CI's limit
# llama7b's shape (SwiGLU, RMSNorm, RoPE, untied output) shrunk to run in seconds: the benchmark's
SMALL_LLAMA = CASES["llama_small"][1:]


@pytest.fixture(scope="module")
def single() -> StepMeasurement:
    """tiny, one process, the default warm-up and repeats (the torchrun runs below are compared with it)."""
    return measure_steps("tiny", CPU, Layout(**BATCH))


FOUR = [*CPU, "hf.num_hidden_layers=4"]  # a 4-layer tiny, for the interleaved and uneven pipelines


@pytest.fixture(scope="module")
def four_layers() -> StepMeasurement:
    """The 4-layer tiny in one process, 1 warm-up and 3 timed steps (the pipelines below train it)."""
    return measure_steps("tiny", FOUR, Layout(**BATCH), repeats=3, warmup=1)


def busy_seconds(boxes: dict) -> float:
    """What a rank's measured boxes (autotuner.validate.in_step.measured_boxes) add up to."""
    return sum(end - start for start, end in boxes.values())


def assert_replay_within_span(replayed: float, span: float, busiest: float) -> None:
    """The replay (autotuner.validate.in_step.replay) places each rank's measured boxes one after another,
    so it ends no earlier than the busiest rank's boxes add up to; it leaves out the schedule's own work
    between a rank's ops, so it ends near the measured span, not past it. A fixed fraction of the span
    as the lower bound would be a claim about the machine's load: with two test suites at once on the two
    cores it read 0.56-0.69 of the span. Past the span it may go by a little: the boxes and hand-overs are
    each rank's own clock readings, and a hand-over's median taken in a loaded moment stands for all of
    them (1.105 and 1.107 of the span in both pipeline tests of one full suite beside its other worker;
    both passed when run again)."""
    assert busiest <= replayed * (1 + 1e-9) and replayed < 1.2 * span, (busiest, replayed, span)


def test_phases_are_the_waited_for_ranks():
    """A rank whose backward ends first waits in the DP reduction for the other: the reduction's time is
    the collective's on the rank the others waited for, not the waiting rank's (which holds the other's
    backward); the step is still the slowest rank's whole step."""

    def rank(r: int, fb: tuple, reduce: tuple, opt: tuple) -> RankSteps:
        return RankSteps(r, 0, 0, r, (0.0, *fb), (0.0, *reduce), (0.0, *opt), (), 0, 0, 0)

    # step 1: rank 0's backward ends 8 s early and its all-reduce takes 9 s; step 2: the other way round
    ranks = (rank(0, (10.0, 19.0), (9.0, 1.5), (2.0, 2.0)), rank(1, (18.0, 11.0), (1.0, 9.5), (3.0, 1.0)))
    layout = Layout(seq_len=16, dp=2, global_batch_size=2, dtype="fp32")
    measured = StepMeasurement("tiny", (), layout, (), 0, 2, "cpu", "", "", ranks)
    assert measured.reduce_s == pytest.approx((1.0 + 1.5) / 2)  # not (9 + 9.5) / 2
    assert measured.optimizer_s == pytest.approx((3.0 + 2.0) / 2)
    assert measured.forward_backward_s == pytest.approx((18.0 + 19.0) / 2)
    assert measured.step_times_s == pytest.approx([22.0, 22.5])


# the model's forward ops: one visit each per micro-batch, the layer's once per layer
FORWARD_OPS = tuple(
    f"{op}.forward" for op in ("embedding", "transformer_layer", "final_layernorm", "output_layer")
)


@pytest.mark.slow
def test_a_single_process_step_is_a_real_training_step(single):
    assert single.layout.microbatches == 4
    assert single.schedule.endswith(".forward_backward_no_pipelining")
    assert single.step_s > 0 and single.forward_backward_s > 0 and single.optimizer_s > 0
    assert single.step_iqr_s >= 0
    (rank,) = single.ranks
    assert len(rank.forward_backward_s) == single.warmup + 1 + single.repeats
    # what stays allocated between steps: the parameters, their gradients and Adam's two states (plus its
    # step counters, 4 bytes per parameter tensor)
    assert 4 * rank.parameter_bytes <= rank.resident_bytes <= 4 * rank.parameter_bytes + 4 * 64
    assert rank.step_peak_bytes > 0 and single.peak_bytes == rank.resident_bytes + rank.step_peak_bytes
    # the tensors Adam steps: tiny's 2 layers of 6 (two RMSNorms, linear_qkv, linear_proj, fc1, fc2), the
    # embedding, the final norm, the output layer
    assert rank.optimizer_tensors == 2 * 6 + 3
    # the same fixed batch every step: a real optimizer step makes its loss fall, step after step
    losses = single.losses
    assert len(losses) == single.warmup + 1 + single.repeats
    assert all(later < earlier for earlier, later in zip(losses, losses[1:], strict=False)), losses
    assert losses[-1] < losses[0] - 0.05, losses
    # each op's time per visit inside the steps (module hooks): every hooked op of the model
    inside = single.in_step(0)
    assert set(inside) == set(IN_STEP_KEYS) and all(seconds > 0 for seconds in inside.values())
    # the embedding, the layers (tiny: 2), the final norm and the head run inside the stage's forward and
    # fill most of it (the rest is GPTModel's own host work). Judged on the spans of one step, the median
    # one (its timeline), not on medians of different visits, which a busy machine moves apart.
    stages = [(start, end) for key, _, start, end in rank.timeline if key == "stage.forward"]
    forward_ops = [visit for visit in rank.timeline if visit[0] in FORWARD_OPS]
    assert len(stages) == single.layout.microbatches and len(forward_ops) == 5 * len(stages)
    assert all(any(s <= start and end <= e for s, e in stages) for _, _, start, end in forward_ops)
    stage_s = sum(e - s for s, e in stages)
    assert 0.5 * stage_s < inside_ops_s(forward_ops) <= stage_s
    assert stage_s < rank.forward_backward_s[single.timeline_step]  # the backwards take the rest


@pytest.mark.slow
def test_the_median_steps_op_visits_are_its_timeline(single):
    """One timed step's visits (the one whose forward-backward is the median), each op of each
    micro-batch once, in time order inside that step's forward-backward, without two ops at once."""
    timed = single.ranks[0].forward_backward_s[single.warmup + 1 :]
    step = single.timeline_step
    assert (
        single.warmup < step
        and single.ranks[0].forward_backward_s[step] == sorted(timed)[(len(timed) - 1) // 2]
    )
    visits = single.ranks[0].timeline
    m = single.layout.microbatches
    counts = {key: sum(1 for v in visits if v[0] == key) for key in IN_STEP_KEYS}
    assert counts == {k: (2 * m if k.startswith("transformer_layer") else m) for k in IN_STEP_KEYS}
    assert (
        sorted(layer for key, layer, _, _ in visits if key == "transformer_layer.forward")
        == [1] * m + [2] * m
    )
    fb = single.ranks[0].forward_backward_s[step]
    assert all(0 <= start < end <= fb for _, _, start, end in visits)
    ops = [v for v in visits if not v[0].startswith("stage.")]
    assert inside_ops_s(ops) == pytest.approx(sum(end - start for _, _, start, end in ops), rel=0.02)
    # forward before backward for each micro-batch: the layer 2 forward of one micro-batch ends before its
    # backward starts, and the layers' backwards run last layer first
    forwards = sorted(v for v in visits if v[0] == "transformer_layer.forward")
    backwards = sorted((v for v in visits if v[0] == "transformer_layer.backward"), key=lambda v: v[2])
    assert [v[1] for v in backwards[:2]] == [2, 1]
    assert max(v[3] for v in forwards if v[1] == 2 and v[2] < backwards[0][2]) <= backwards[0][2]
    # the embedding's backward (ended by its table's accumulated gradient) closes each micro-batch's
    # backward: after the first layer's starts, before the next micro-batch's forward
    embedding = sorted(v for v in visits if v[0] == "embedding.backward")
    firsts = sorted(v for v in backwards if v[1] == 1)
    starts = sorted(v[2] for v in visits if v[0] == "stage.forward")
    for n, (layer, table) in enumerate(zip(firsts, embedding, strict=True)):
        assert layer[2] < table[2] and (n + 1 == m or table[3] <= starts[n + 1])


def test_a_pipelines_handovers_are_the_waits_for_a_neighbour():
    """Two stages, two micro-batches, one layer each: stage 1 waits 0.5 for micro-batch 1's activation;
    micro-batch 2's arrives while it runs its backward (busy: not a hand-over it waited for); stage 0
    waits 1.5 and 1.0 for the two gradients."""
    from autotuner.validate.in_step import handovers, replay

    first = [
        ("stage.forward", 0, 0.0, 2.0),
        ("embedding.forward", 0, 0.0, 0.5),
        ("transformer_layer.forward", 1, 0.5, 2.0),
        ("stage.forward", 0, 2.1, 4.0),
        ("embedding.forward", 0, 2.1, 2.4),
        ("transformer_layer.forward", 1, 2.4, 4.0),
        ("transformer_layer.backward", 1, 10.0, 12.0),
        ("transformer_layer.backward", 1, 14.0, 16.0),
    ]
    second = [
        ("stage.forward", 0, 2.5, 5.0),
        ("transformer_layer.forward", 2, 2.5, 4.0),
        ("output_layer.forward", 0, 4.0, 5.0),
        ("output_layer.backward", 0, 5.2, 5.5),
        ("transformer_layer.backward", 2, 5.5, 8.5),
        ("stage.forward", 0, 9.0, 11.0),
        ("transformer_layer.forward", 2, 9.0, 10.5),
        ("output_layer.forward", 0, 10.5, 11.0),
        ("transformer_layer.backward", 2, 11.5, 13.0),
    ]
    found = handovers([first, second], places=((0, 0), (1, 0)))
    assert sorted((phase, round(seconds, 9)) for phase, seconds in found) == [
        ("backward", 1.0),
        ("backward", 1.5),
        ("forward", 0.5),
    ]
    # The same step replayed by the predictor's schedule, each forward and backward taking its measured
    # time (stage 0: 2, 1.9 and 2, 2; stage 1: 2.5, 2 and 3.3 with the output layer's, 1.5), 0.5 per
    # exchange: stage 1 runs [2.5, 5], [5, 8.3], [8.8, 10.8], [10.8, 12.3]; stage 0's last backward
    # waits for its gradient: [12.8, 14.8]. Measured: 0 to 16, the gaps the schedule's model leaves out.
    places = ((0, 0), (1, 0))
    assert replay([first, second], places, microbatches=2, exchange_s=0.5) == pytest.approx(14.8)
    assert replay([first, second], places, microbatches=3, exchange_s=0.5) is None


@pytest.mark.parametrize(
    ("p", "v", "m", "layers", "first", "last"),
    [(2, 1, 4, 4, None, None), (2, 2, 4, 8, None, None), (4, 1, 4, 8, None, None), (2, 3, 4, 12, None, None)]
    + [(2, 1, 4, 4, 3, None), (4, 2, 4, 12, 2, 2), (3, 1, 3, 5, None, 1)],  # uneven: Megatron's first/last
)
def test_a_timeline_cuts_into_the_schedules_boxes_and_replays_to_its_own_end(p, v, m, layers, first, last):
    """A step made by the schedule itself (each box's visits as the hooks record them: a chunk's forward
    one stage.forward around its layers' forwards, the embedding first and the head last; its backward the
    head's, then its layers' in reverse, then the embedding's) cuts back into the same boxes, its
    hand-overs are the exchanges, and replayed with that exchange it ends where it ended."""
    from autotuner.predict.schedule import simulate
    from autotuner.validate.in_step import handovers, measured_boxes, replay

    x = 0.25
    split = Layout(
        seq_len=8, pp=p, vpp=v, global_batch_size=m, first_stage_layers=first, last_stage_layers=last
    )
    places = split.layer_places(layers)

    def duration(key):
        return (1.0 if key[1] == "forward" else 2.0) * (1 + 0.1 * key[0])

    sched = simulate(duration, p, v, m, x, overlapped=v > 1)
    stages = [[] for _ in range(p)]
    for box in sched.boxes:
        own = [n + 1 for n, place in enumerate(places) if place == (box.stage, box.chunk)]
        head = box.stage == p - 1 and box.chunk == v - 1
        lead = box.stage == 0 and box.chunk == 0
        step = (box.end - box.start) / (len(own) + 2)
        at = box.start
        visits = []
        if box.phase == "forward":
            names = [("embedding.forward", 0)] * lead + [("transformer_layer.forward", n) for n in own]
            names += [("output_layer.forward", 0)] * head
            stages[box.stage].append(("stage.forward", 0, box.start, box.end))
        else:
            names = [("output_layer.backward", 0)] * head
            names += [("transformer_layer.backward", n) for n in reversed(own)]
            names += [("embedding.backward", 0)] * lead
        for i, (key, layer) in enumerate(names):
            start = box.start if i == 0 else at
            end = box.end if i == len(names) - 1 else start + step
            visits.append((key, layer, start, end))
            at = end
        stages[box.stage] += visits
    for s in range(p):
        cut = measured_boxes(stages[s], places, s)
        mine = {(b.phase, b.microbatch, b.chunk): (b.start, b.end) for b in sched.boxes if b.stage == s}
        assert cut is not None and set(cut) == set(mine)
        assert all(cut[key] == pytest.approx(mine[key]) for key in mine)
    found = handovers(stages, places)
    assert found and all(seconds == pytest.approx(x) for _, seconds in found)
    assert replay(stages, places, m, x, overlapped=v > 1) == pytest.approx(sched.end)


def test_host_work_is_the_time_outside_the_ops_split_by_phase():
    """Two micro-batches in 10 s: each model forward (0-3, 5-8) holds 2 s of ops, so 1 s of its own; the
    ops take 2 + 2 + 1 + 1 of the backward's time besides; what is left of the 10 s is backward host work."""
    from autotuner.validate.in_step import host_work_s

    visits = [
        ("stage.forward", 0, 0.0, 3.0),
        ("transformer_layer.forward", 1, 0.5, 1.5),
        ("output_layer.forward", 0, 1.5, 2.5),
        ("output_layer.backward", 0, 3.5, 4.0),
        ("transformer_layer.backward", 1, 4.0, 4.5),
        ("stage.forward", 0, 5.0, 8.0),
        ("transformer_layer.forward", 1, 5.0, 6.0),
        ("output_layer.forward", 0, 6.0, 7.0),
        ("output_layer.backward", 0, 8.5, 9.0),
        ("transformer_layer.backward", 1, 9.0, 9.5),
    ]
    forward, backward = host_work_s(visits, forward_backward_s=10.0, microbatches=2)
    assert forward == pytest.approx(1.0)  # (3 - 2) per model forward
    assert backward == pytest.approx((10 - 6) / 2 - 1.0)  # between the ops, less the forward's part


@pytest.mark.slow
def test_a_real_steps_host_work_is_its_time_between_the_ops(single):
    """On the tiny model's real steps: positive in both phases, the forward's inside the model's forward,
    and the two together all the time between the ops (the calibration times it so on a smaller model)."""
    from autotuner.validate.in_step import host_work_s

    rank, m = single.ranks[0], single.layout.microbatches
    fb = rank.forward_backward_s[single.timeline_step]
    forward, backward = host_work_s(rank.timeline, fb, m)
    assert 0 < forward < single.in_step(0)["stage.forward"] and backward > 0
    ops = [v for v in rank.timeline if not v[0].startswith("stage.")]
    assert (forward + backward) * m == pytest.approx(fb - inside_ops_s(ops))


def test_flushing_inside_the_layers_trains_the_same_with_each_flush_inside_a_layer_visit(single):
    """flush_in_layers (the calibration's flushed host work): the same losses as without, each layer visit
    (forward and backward) holding a whole flush of the last-level cache, so that the flushes stay out
    of the time between the ops; the steps' command line carries the setting to its processes."""
    import time

    import torch

    from autotuner.measure.cache import CacheFlusher
    from autotuner.validate.steps import parse_args, steps_command

    flushed = measure_steps("tiny", CPU, Layout(**BATCH), repeats=2, warmup=1, flush_in_layers=True)
    assert flushed.losses == pytest.approx(single.losses[: len(flushed.losses)], rel=1e-6)
    flush = CacheFlusher(torch.device("cpu"))
    fastest = min(_timed(flush, time.perf_counter) for _ in range(5))
    layers = [
        end - start for key, _, start, end in flushed.ranks[0].timeline if key.startswith("transformer_")
    ]
    assert len(layers) == 2 * 2 * single.layout.microbatches  # 2 layers, forward and backward
    assert min(layers) > 0.5 * fastest
    command = steps_command("tiny", CPU, Layout(**BATCH), 2, 1, "out.json", flush_in_layers=True)
    assert "flush_in_layers=true" in command
    own, _, _ = parse_args(command[command.index("autotuner.validate.steps_main") + 1 :])
    assert own["flush_in_layers"] is True
    own, layout, _ = parse_args(["out=o.json", "layout.seq_len=16"])
    assert own["flush_in_layers"] is False
    # the steps run here: without layout.dtype, this machine's (fp32 on a CPU), not a GPU job's bf16
    assert layout.dtype == ("bf16" if torch.cuda.is_available() else "fp32")
    assert parse_args(["out=o.json", "layout.seq_len=16", "layout.dtype=bf16"])[1].dtype == "bf16"
    with pytest.raises(UserError, match="flush_in_layers='maybe' is not true or false"):
        parse_args(["out=o.json", "layout.seq_len=16", "flush_in_layers=maybe"])


def _timed(call, clock) -> float:
    start = clock()
    call()
    return clock() - start


def test_visits_are_merged_as_the_time_inside_some_op():
    visits = [
        ("stage.forward", 0, 0.0, 10.0),  # holds the ops: not counted
        ("transformer_layer.forward", 1, 1.0, 3.0),
        ("transformer_layer.forward", 2, 2.5, 4.0),  # overlapping another rank's hooks would: counted once
        ("output_layer.forward", 0, 6.0, 7.0),
    ]
    assert inside_ops_s(visits) == pytest.approx(3.0 + 1.0)
    assert inside_ops_s([]) == 0.0


def test_full_recompute_trains_the_same_and_holds_less(single):
    """Megatron's activation recompute on the CPU (cpu_bridges 12): the same losses, a lower peak (each
    layer keeps only its input; the re-run forward happens inside the backward)."""
    result = measure_steps("tiny", CPU, Layout(**BATCH, recompute="full"), repeats=1, warmup=1)
    assert result.losses == pytest.approx(single.losses[:3], rel=1e-6)
    assert result.ranks[0].step_peak_bytes < single.ranks[0].step_peak_bytes
    assert result.in_step(0) == {}  # the re-run forward would fire the module hooks twice: not timed


def test_a_bf16_model_keeps_fp32_main_gradients_and_master_weights(single):
    """Megatron's mixed precision: bf16 parameters (2 B), fp32 main gradients (4 B), fp32 master weights
    and Adam's two states (12 B): 9 times the parameters' bytes held between steps, as the prediction
    counts them. The fp32 masters take Adam's small steps whole, so training follows fp32's."""
    result = measure_steps("tiny", CPU, Layout(**{**BATCH, "dtype": "bf16"}), repeats=1, warmup=1)
    (rank,) = result.ranks
    assert rank.parameter_bytes == single.ranks[0].parameter_bytes // 2
    assert 9 * rank.parameter_bytes <= rank.resident_bytes <= 9 * rank.parameter_bytes + 4 * 64
    assert result.optimizer.endswith("over fp32 master weights")
    # the embedding's backward ends after its table's main-gradient add (the clock's hook runs last)
    assert result.in_step(0)["embedding.backward"] > 0
    assert result.losses == pytest.approx(single.losses[:3], abs=0.01)
    assert result.losses[-1] < result.losses[0] - 0.05


@pytest.mark.slow
def test_a_llama_shaped_model_at_reduced_width():
    result = measure_steps("llama7b", [*CPU, *SMALL_LLAMA], Layout(**BATCH), repeats=3, warmup=1)
    assert result.step_s > 0 and result.peak_bytes > result.ranks[0].resident_bytes > 0
    assert result.losses[-1] < result.losses[0]


def test_layouts_the_steps_cannot_measure_are_refused_in_one_line(tmp_path, capsys):
    for split in ({"tp": 2}, {"pp": 2}, {"dp": 2}):  # one process, a layout of two
        with pytest.raises(UserError, match="2 processes") as info:
            measure_steps("tiny", CPU, Layout(**split, **BATCH))
        assert "\n" not in str(info.value)
    # the command line's words: a flag that is not true or false is refused, not taken as true
    from autotuner.validate.steps_main import main

    out = tmp_path / "steps.json"
    with pytest.raises(SystemExit) as exited:
        main([f"out={out}", "case=tiny", "layout.seq_len=16", "layout.distributed_optimizer=maybe"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "distributed_optimizer='maybe' must be true or false" in err and len(err.strip().splitlines()) == 1
    assert not out.exists()
    with pytest.raises(UserError, match="set by the layout"):
        measure_steps("tiny", [*CPU, "dtype=bf16"], Layout(**BATCH))


@pytest.mark.torchrun
@pytest.mark.slow
@pytest.mark.parametrize(
    "split",
    [{"tp": 2, "sequence_parallel": True}, {"dp": 2}, {"dp": 2, "distributed_optimizer": True}],
    ids=["tp2_sp", "dp2", "dp2_distributed_optimizer"],
)
def test_tensor_and_data_parallel_steps_under_torchrun(tmp_path, single, split):
    result = run_steps("tiny", CPU, Layout(**split, **BATCH), tmp_path / "steps.json", timeout_s=WATCHDOG_S)
    tp = split.get("tp", 1)
    expected = [(0, 0, 0), (1, 1, 0)] if tp == 2 else [(0, 0, 0), (1, 0, 1)]
    assert [(r.rank, r.tp_rank, r.dp_rank) for r in result.ranks] == expected
    timed = slice(result.warmup + 1, None)
    for rank in result.ranks:
        assert min(rank.forward_backward_s[timed]) > 0 and rank.step_peak_bytes > 0
        # gradients reduced between the backward and Adam: the sequence-parallel norms' over TP, all over DP
        assert min(rank.reduce_s[timed]) > 0
        # TP: each rank holds about half of the sharded weights (the norms are whole on both); DP: all
        share = rank.parameter_bytes / single.ranks[0].parameter_bytes
        assert share < 0.75 if tp == 2 else share == pytest.approx(1, abs=1e-5)  # (+ padding to dp)
        # gathered from every rank: what each one's Adam steps (the distributed optimizer: one share of
        # the flat buffer, else every parameter tensor)
        stepped = 1 if split.get("distributed_optimizer") else single.ranks[0].optimizer_tensors
        assert rank.optimizer_tensors == stepped
    if tp == 1:
        # DP ranks run the same shapes, so the same peak: the collectives' gloo copies, whose frees the
        # profiler can miss, are outside the meter (steps docstring, "Peak memory")
        first, second = (r.step_peak_bytes for r in result.ranks)
        assert second == pytest.approx(first, rel=0.01)
    for rank in result.ranks:
        if split.get("distributed_optimizer"):
            # the weights and the whole gradient buffer (4 B + 4 B), Adam's two states for half of them
            params = rank.parameter_bytes
            assert 12 * params / 4 <= rank.resident_bytes <= 12 * params / 4 + 4 * 64
    # a step lasts as long as its slowest rank
    slowest = [
        max(r.forward_backward_s[i] + r.reduce_s[i] + r.optimizer_s[i] for r in result.ranks)
        for i in (-1, -2)
    ]
    assert result.step_times_s[-2:] == pytest.approx(slowest[::-1])
    assert result.command[2:4] == ("torch.distributed.run", "--standalone")
    # TP: the single-process model split over the ranks; DP: each rank half of the same global batch and
    # the gradients averaged (the distributed optimizer: each rank steps its half of the parameters and
    # the halves are gathered): either way the same training as one process, step by step
    assert result.losses == pytest.approx(single.losses, rel=1e-4)


def test_a_failed_step_run_says_why_not_torchruns_banner():
    from autotuner.validate.steps import _worker_error

    banner = "\n".join(["Traceback (most recent call last):", "  File x", "ChildFailedError: ", "=" * 60])
    worker = (
        "autotuner: error: invalid HF config for case: heads: fix the case file or the hf.<field> overrides"
    )
    assert _worker_error(f"warning\n{worker}\n{worker}\n{banner}") == worker
    crash = "Traceback (most recent call last):\n  File y\nRuntimeError: Connection reset by peer"
    assert _worker_error(f"{crash}\n{banner}") == "RuntimeError: Connection reset by peer"
    assert _worker_error("just this\n") == "just this" and _worker_error("") == ""
    # once a process group exists, torch.distributed's excepthook prefixes each line with the rank
    ranked = "\n".join(f"[rank1]: {line}" for line in crash.splitlines())
    assert _worker_error(f"{ranked}\n{banner}") == "RuntimeError: Connection reset by peer"
    # a worker killed by a signal prints nothing: torchrun's root cause says which and how
    root = ["Root Cause (first observed failure):", "[0]:", "  rank      : 1 (local_rank: 1)"]
    root += [
        "  exitcode  : -9 (pid: 4242)",
        "  traceback : Signal 9 (SIGKILL) received by PID 4242",
        "=" * 60,
    ]
    killed = "\n".join(["Traceback (most recent call last):", "ChildFailedError: ", *root])
    assert _worker_error(killed) == "rank 1 was killed by SIGKILL, printing no error"


@pytest.mark.torchrun
@pytest.mark.slow
def test_pipeline_parallel_steps_with_megatrons_1f1b_schedule(tmp_path, single):
    result = run_steps("tiny", CPU, Layout(pp=2, **BATCH), tmp_path / "pp2.json", timeout_s=WATCHDOG_S)
    assert [(r.rank, r.tp_rank, r.pp_rank) for r in result.ranks] == [(0, 0, 0), (1, 0, 1)]
    first, last = result.ranks
    assert result.schedule.endswith(".forward_backward_pipelining_without_interleaving")  # 1F1B
    assert not first.losses and last.losses  # the loss exists on the last stage only
    for rank in result.ranks:
        assert min(rank.forward_backward_s[result.warmup + 1 :]) > 0 and rank.step_peak_bytes > 0
    # the pipeline ran the single-process model (same seed, same weights, same batch): the same loss at
    # the first step, and the same training after it
    assert last.losses[0] == pytest.approx(single.losses[0], rel=1e-6)
    assert last.losses == pytest.approx(single.losses, rel=1e-4)
    # each stage's ops inside the steps, its own: the embedding on the first, the head on the last
    assert "embedding.forward" in result.in_step(0) and "output_layer.backward" not in result.in_step(0)
    assert "output_layer.backward" in result.in_step(1) and "embedding.forward" not in result.in_step(1)
    assert result.in_step(1)["transformer_layer.backward"] > 0
    # the two ranks' timelines on one time axis (the wall clock at each one's start: they leave the barrier
    # apart): each rank's visits inside its own forward-backward, and stage 1's layer forward of a
    # micro-batch starts only after stage 0's ended and handed it over
    step = result.timeline_step
    assert min(r.timeline_start_s for r in result.ranks) == 0.0
    for r in result.ranks:
        begin, finish = r.timeline_start_s, r.timeline_start_s + r.forward_backward_s[step]
        assert all(begin <= start < end <= finish + 1e-4 for _, _, start, end in r.timeline)
    assert {visit[1] for visit in first.timeline} == {0, 1}  # its layer 1, and the embedding
    assert {visit[1] for visit in last.timeline} == {0, 2}

    def layer_forwards(rank):
        return sorted(v for v in rank.timeline if v[0] == "transformer_layer.forward")

    assert len(layer_forwards(first)) == len(layer_forwards(last)) == 4
    for sent, received in zip(layer_forwards(first), layer_forwards(last), strict=True):
        assert sent[3] <= received[2], (sent, received)
    # the hand-overs a stage waited for: stage 1 at least for the first micro-batch's activation
    from autotuner.validate.validate import RankTimeline, pipeline_handovers

    timelines = [
        RankTimeline(
            r.rank,
            r.pp_rank,
            r.tp_rank,
            r.dp_rank,
            r.forward_backward_s[step],
            r.timeline,
            r.timeline_start_s,
        )
        for r in result.ranks
    ]
    found = pipeline_handovers(timelines, result.layout, layers=2)
    assert "forward" in {phase for phase, _ in found} and all(
        0 < s < timelines[1].forward_backward_s for _, s in found
    )
    # each rank's visits make its 4 forwards and 4 backwards, and the predictor's schedule, given their
    # measured times and the median hand-over, ends near the measured span (it leaves out the schedule's
    # own work between a rank's ops: under it, not far)
    from autotuner.validate.in_step import measured_boxes
    from autotuner.validate.validate import pipeline_replay

    busiest = 0.0
    for r in result.ranks:
        boxes = measured_boxes(r.timeline, result.layout.layer_places(2), r.pp_rank)
        assert boxes is not None and sorted(boxes) == [
            (ph, mb, 0) for ph in ("backward", "forward") for mb in range(4)
        ]
        busiest = max(busiest, busy_seconds(boxes))
    replayed, span = pipeline_replay(timelines, result.layout, 2, found, "cpu")
    assert_replay_within_span(replayed, span, busiest)


@pytest.mark.torchrun
@pytest.mark.slow
def test_interleaved_pipeline_steps_train_what_one_process_trains(tmp_path, four_layers):
    """pp=2 vpp=2 on a 4-layer tiny: rank 0 holds layers 1 and 3, rank 1 layers 2 and 4 (Megatron's
    interleaved schedule); every activation and gradient crosses between the two ranks in both
    directions, so a mismatched exchange (an activation received as a gradient) would change the loss."""
    four, alone = FOUR, four_layers
    layout = Layout(pp=2, vpp=2, **BATCH)
    # 5 timed steps: the timeline is the median one's, and on this 2-core VM a step can hold a stall of
    # the host's (a median of 3 once held one: replayed at 0.66 of its span); the one-process fixture
    # trains 3, so the two trainings are compared over its steps
    result = run_steps(
        "tiny", four, layout, tmp_path / "vpp2.json", repeats=5, warmup=1, timeout_s=WATCHDOG_S
    )
    assert result.schedule.endswith(".forward_backward_pipelining_with_interleaving")
    assert result.losses[0] == pytest.approx(alone.losses[0], rel=1e-6)
    assert len(result.losses) == len(alone.losses) + 2
    assert result.losses[: len(alone.losses)] == pytest.approx(alone.losses, rel=1e-4)
    # each rank holds half of the layers, the first the embedding, the last the output layer
    assert all(r.parameter_bytes < alone.ranks[0].parameter_bytes for r in result.ranks)
    # each rank's median step cuts into its chunks' forwards and backwards (4 micro-batches x 2 chunks
    # each), and the predictor's interleaved schedule replays them near the measured span
    from autotuner.validate.in_step import measured_boxes
    from autotuner.validate.validate import RankTimeline, pipeline_handovers, pipeline_replay

    step = result.timeline_step
    timelines = [
        RankTimeline(r.rank, r.pp_rank, r.tp_rank, r.dp_rank, r.forward_backward_s[step], r.timeline)
        for r in result.ranks
    ]
    busiest = 0.0
    for r in timelines:
        boxes = measured_boxes(r.visits, layout.layer_places(4), r.pp_rank)
        assert boxes is not None and len(boxes) == 2 * 4 * 2
        busiest = max(busiest, busy_seconds(boxes))
    found = pipeline_handovers(timelines, layout, 4)
    assert found
    replayed, span = pipeline_replay(timelines, layout, 4, found, "cpu")
    assert_replay_within_span(replayed, span, busiest)


@pytest.mark.parametrize(
    ("layers", "pp", "vpp", "first", "last"),
    [(12, 4, 2, 2, 2), (4, 2, 1, 3, None), (5, 3, 1, None, 1), (8, 2, 2, None, None), (10, 3, 1, 4, None)],
)
def test_layer_places_are_where_megatron_builds_the_layers(layers, pp, vpp, first, last):
    """Layout.layer_places against Megatron-Core's own offset and count per (rank, chunk)."""
    import torch
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    config = TransformerConfig(
        num_layers=layers,
        hidden_size=64,
        num_attention_heads=4,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
        num_layers_in_first_pipeline_stage=first,
        num_layers_in_last_pipeline_stage=last,
        pipeline_dtype=torch.float32,
    )
    theirs: list = [None] * layers
    for rank in range(pp):
        for chunk in range(vpp):
            vp_stage = chunk if vpp > 1 else None
            offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=rank)
            for index in range(offset, offset + get_num_layers_to_build(config, vp_stage, rank)):
                assert theirs[index] is None
                theirs[index] = (rank, chunk)
    split = Layout(
        seq_len=8, pp=pp, vpp=vpp, global_batch_size=2 * pp, first_stage_layers=first, last_stage_layers=last
    )
    assert split.layer_places(layers) == tuple(theirs)


@pytest.mark.torchrun
@pytest.mark.slow
def test_an_uneven_pipeline_split_trains_what_one_process_trains(tmp_path, four_layers):
    """pp=2 with first_stage_layers=3 on the 4-layer tiny (Megatron's num_layers_in_first_pipeline_stage):
    rank 0 holds the embedding and layers 1-3, rank 1 layer 4 and the head; the same training as one
    process, the split where the layout says, and the timelines cut into the schedule's boxes."""
    from autotuner.validate.in_step import measured_boxes
    from autotuner.validate.validate import RankTimeline, pipeline_handovers, pipeline_replay

    layout = Layout(pp=2, first_stage_layers=3, **BATCH)
    result = run_steps(
        "tiny", FOUR, layout, tmp_path / "uneven.json", repeats=3, warmup=1, timeout_s=WATCHDOG_S
    )
    first, last = result.ranks
    assert last.losses == pytest.approx(four_layers.losses, rel=1e-4)
    assert {v[1] for v in first.timeline if v[0].startswith("transformer_layer")} == {1, 2, 3}
    assert {v[1] for v in last.timeline if v[0].startswith("transformer_layer")} == {4}
    places = layout.layer_places(4)
    assert places == ((0, 0), (0, 0), (0, 0), (1, 0))
    busiest = 0.0
    for r in result.ranks:
        boxes = measured_boxes(r.timeline, places, r.pp_rank)
        assert boxes is not None and len(boxes) == 2 * 4
        busiest = max(busiest, busy_seconds(boxes))
    step = result.timeline_step
    timelines = [
        RankTimeline(r.rank, r.pp_rank, r.tp_rank, r.dp_rank, r.forward_backward_s[step], r.timeline)
        for r in result.ranks
    ]
    found = pipeline_handovers(timelines, layout, 4)
    replayed, span = pipeline_replay(timelines, layout, 4, found, "cpu")
    assert_replay_within_span(replayed, span, busiest)


@pytest.mark.torchrun
@pytest.mark.slow
def test_expert_parallel_steps_of_the_moe_model(tmp_path):
    """tiny_moe at dp=2 ep=2: each rank holds half of the routed experts, the dispatcher's all-to-all
    brings the tokens to them, the dense gradients are averaged over the two DP ranks (the experts' have
    one rank per expert-data-parallel group: nothing to reduce)."""
    result = run_steps(
        "tiny_moe", CPU, Layout(dp=2, ep=2, **BATCH), tmp_path / "ep2.json", timeout_s=WATCHDOG_S
    )
    assert [(r.rank, r.dp_rank) for r in result.ranks] == [(0, 0), (1, 1)]
    # cases/tiny_moe.yaml, counted: per layer two RMSNorms, QKV (4 query + 2x2 KV heads of 16), the
    # projection, the router (8 experts) and the 8 SwiGLU experts (3*h*ffn each), then the embedding, the
    # untied output layer and the final norm
    h, ffn, vocab, layers, experts = 64, 128, 1024, 2, 8
    dense = layers * (2 * h + h * (4 + 2 * 2) * 16 + 4 * 16 * h + h * experts) + 2 * vocab * h + h
    routed = layers * experts * 3 * h * ffn
    for rank in result.ranks:
        assert rank.parameter_bytes == 4 * (dense + routed // 2)
        assert min(rank.reduce_s[result.warmup + 1 :]) > 0 and rank.step_peak_bytes > 0
    assert result.losses[-1] < result.losses[0] - 0.05


# A command that starts a grandchild (as torchrun starts its workers), writes the grandchild's pid to the
# file it is given and waits: what run_process_group must stop whole.
SOURCE = Path(__file__).resolve().parents[1]
GRANDPARENT = (
    "import subprocess, sys, time\n"
    "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
    "open(sys.argv[1], 'w').write(str(child.pid))\n"
    "time.sleep(120)\n"
)


def _running(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, ended but not yet reaped by whoever adopted it, does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def _ends(pid: int, within_s: float = 10) -> bool:
    """Whether ``pid`` stops running within ``within_s`` (a killed process ends a moment after the kill)."""
    deadline = time.monotonic() + within_s
    while _running(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not _running(pid)


def _grandchild(pid_file: Path) -> int:
    deadline = time.monotonic() + 30
    while not (pid_file.exists() and pid_file.read_text()):
        assert time.monotonic() < deadline, "the command never started its grandchild"
        time.sleep(0.05)
    return int(pid_file.read_text())


@pytest.mark.slow
def test_a_step_run_past_its_timeout_is_stopped_with_every_process_it_started(tmp_path):
    pid_file = tmp_path / "grandchild.pid"
    with pytest.raises(subprocess.TimeoutExpired):
        run_process_group([sys.executable, "-c", GRANDPARENT, str(pid_file)], dict(os.environ), timeout_s=3)
    assert _ends(_grandchild(pid_file))


def test_a_sigterm_while_steps_run_stops_them_and_ends_as_a_sigterm_would(tmp_path):
    """What SLURM sends at the time limit: the waiting process ends with SIGTERM's status, and the steps'
    processes, which the signal to it does not reach, are stopped with it."""
    pid_file = tmp_path / "grandchild.pid"
    waiter = (
        "import os, sys\n"
        "from autotuner.validate.steps import run_process_group\n"
        "run_process_group([sys.executable, '-c', sys.argv[1], sys.argv[2]], dict(os.environ), 600)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", waiter, GRANDPARENT, str(pid_file)], cwd=SOURCE)
    grandchild = _grandchild(pid_file)
    assert _running(grandchild)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == -signal.SIGTERM
    assert _ends(grandchild)


def test_a_sigterm_under_an_entry_point_removes_its_temporary_folders_then_ends_as_a_sigterm_would(tmp_path):
    """autotuner-validate, autotuner.calibrate and the benchmarks keep their steps and
    profiles in temporary folders; under autotuner.termination.unwinding_on_sigterm (theirs, and a nested
    one as autotuner.main's inside a benchmark) a SIGTERM while the steps run stops the steps' processes,
    removes both folders on the way out, and still ends the process by SIGTERM."""
    pid_file, scratch = tmp_path / "grandchild.pid", tmp_path / "scratch"
    scratch.mkdir()
    waiter = (
        "import os, sys, tempfile\n"
        "from autotuner.validate.steps import run_process_group\n"
        "from autotuner.termination import unwinding_on_sigterm\n"
        "with unwinding_on_sigterm(), tempfile.TemporaryDirectory(dir=sys.argv[3]) as outer:\n"
        "    with unwinding_on_sigterm(), tempfile.TemporaryDirectory(dir=outer):\n"
        "        run_process_group([sys.executable, '-c', sys.argv[1], sys.argv[2]], dict(os.environ), 600)\n"
    )
    command = [sys.executable, "-c", waiter, GRANDPARENT, str(pid_file), str(scratch)]
    proc = subprocess.Popen(command, cwd=SOURCE)
    grandchild = _grandchild(pid_file)
    (outer,) = scratch.iterdir()
    assert len(list(outer.iterdir())) == 1
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == -signal.SIGTERM
    assert _ends(grandchild)
    assert list(scratch.iterdir()) == []
