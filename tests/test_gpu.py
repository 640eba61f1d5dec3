"""The CUDA paths, on a real GPU: CUDA-event timing, the caching allocator's peak, CUDA-graph replay, the
functional ops' host transfers, and a whole run on the device.

Without CUDA every test here is skipped (and counted as skipped, not passed): CI has no GPU. They run on
a lent GPU machine through scripts/gpu_check.sh; docs/gpu_validation.md records what they showed.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from autotuner.launchers.get_data import GetDataObserver
from autotuner.main import run
from autotuner.measure.graphs import capture_phase
from autotuner.measure.timer import DeviceTimer, SamplingPolicy, sample
from autotuner.ops_test.base import OpCall, ShapePoint
from autotuner.results import load_rows
from autotuner.runner import Phase

pytestmark = pytest.mark.gpu  # skipped without CUDA (tests/conftest.py)

CUDA = torch.device("cuda")
N, IN, OUT = 96, 128, 320
FP32 = 4
QUICK = SamplingPolicy(warmup=2, min_samples=5, max_samples=200, budget_s=0.3)


def _linear_phase(phase: str, n: int = N, d_in: int = IN, d_out: int = OUT) -> tuple[Phase, torch.nn.Linear]:
    torch.manual_seed(0)
    linear = torch.nn.Linear(d_in, d_out, bias=False, device=CUDA)
    x = torch.randn(n, d_in, device=CUDA, requires_grad=True)
    return Phase(phase, OpCall(linear, (x,), linear), seed=0), linear


def test_events_time_the_device_not_the_launch():
    cycles = 20_000_000  # ~10 ms of spinning at a GPU's clock; its launch takes microseconds
    torch.cuda._sleep(1000)
    torch.cuda.synchronize()
    begin = time.perf_counter_ns()
    torch.cuda._sleep(cycles)
    launch_ns = time.perf_counter_ns() - begin
    torch.cuda.synchronize()
    device_ns = DeviceTimer(CUDA).time_ns(lambda: torch.cuda._sleep(cycles))
    assert device_ns > 1_000_000 and device_ns > 20 * launch_ns, (device_ns, launch_ns)


def test_linear_figures_from_the_caching_allocator_are_exact():
    observer = GetDataObserver(CUDA, QUICK, [])
    forward, linear = _linear_phase("forward")
    observer.model_parameters = list(linear.parameters())
    row = observer.observe(None, ShapePoint(N, 1), forward)
    assert row["peak_bytes"] == N * OUT * FP32  # the output (sizes chosen as multiples of 512 B)
    assert row["activation_bytes"] == N * IN * FP32
    assert row["flops"] == 2 * N * IN * OUT and row["cuda_graph"] is False
    backward, linear = _linear_phase("backward")
    observer.model_parameters = list(linear.parameters())
    row = observer.observe(None, ShapePoint(N, 1), backward)
    assert row["peak_bytes"] == N * IN * FP32 + IN * OUT * FP32  # grad of the input and of the weight


def test_a_backward_peak_on_the_gpu_is_what_the_cpu_meter_reads():
    """tests/test_sensors.py's backward on CUDA: the caching allocator's counters see the forward's saved
    result freed as the backward consumes it, as the CPU meter now does, so both read B, not B + the
    input's gradient (sizes multiples of 512 B)."""
    rows, cols, copies = 64, 128, 8

    class RepeatExp(torch.nn.Module):
        def forward(self, x):
            return x.repeat(1, copies).exp().sum(dim=1)

    x = torch.randn(rows, cols, device=CUDA, requires_grad=True)
    row = GetDataObserver(CUDA, QUICK, []).observe(
        None, ShapePoint(rows, 1), Phase("backward", OpCall(RepeatExp(), (x,)), 0)
    )
    assert row["peak_bytes"] == rows * cols * copies * FP32


def test_graph_replay_computes_what_eager_computes():
    eager, linear = _linear_phase("backward")
    eager.prepare()
    eager.run()
    expected = (eager.call.inputs[0].grad.clone(), linear.weight.grad.clone())
    replay = capture_phase(eager)
    for _ in range(3):
        replay()
    torch.cuda.synchronize()
    grad_input, grad_weight = replay.outputs
    assert not replay.empty
    torch.testing.assert_close(grad_input, expected[0])
    torch.testing.assert_close(grad_weight, expected[1])


def test_a_phase_without_gpu_work_is_replayed_and_called_empty():
    """An add's backward hands the incoming gradient on: no kernel, an empty graph, and the replay says so."""
    x, y = (torch.randn(64, device=CUDA, requires_grad=True) for _ in range(2))
    replay = capture_phase(Phase("backward", OpCall(torch.add, (x, y)), seed=0))
    replay()
    assert replay.empty


def test_a_norm_whose_weight_ran_eagerly_before_is_captured():
    """Seen on an H100 with backward() in the capture: a norm whose weight had been through an eager
    forward and backward (on the default stream) failed ("would make the legacy stream depend on a
    capturing blocking stream"); autograd.grad, which runs no AccumulateGrad node, must not."""
    torch.manual_seed(0)
    norm = torch.nn.RMSNorm(4096, eps=1e-5, device=CUDA, dtype=torch.bfloat16)
    x = torch.randn(512, 1, 4096, device=CUDA, dtype=torch.bfloat16, requires_grad=True)
    phase = Phase("backward", OpCall(norm, (x,), norm), seed=0)
    for _ in range(2):  # eager, on the default stream, as the observer's probe runs it
        phase.prepare()
        phase.run()
    keep = norm(x)  # a live graph holding the weight's AccumulateGrad node from the default stream
    replay = capture_phase(phase)
    replay()
    torch.cuda.synchronize()
    assert keep is not None and all(g is not None for g in replay.outputs)


def test_graph_replay_removes_launch_overhead_of_a_small_op():
    """A [8, 8] linear's kernels take a few microseconds; eager calls are bound by the host's launch
    rate, so the replayed time is the shorter one."""
    rows = {}
    for graphed in (False, True):
        observer = GetDataObserver(CUDA, QUICK, [], cuda_graph_below_us=1e6 if graphed else None)
        for phase_name in ("forward", "backward"):
            phase, _ = _linear_phase(phase_name, 8, 8, 8)
            rows[graphed, phase_name] = observer.observe(None, ShapePoint(8, 1), phase)
    for phase_name in ("forward", "backward"):
        eager, replayed = rows[False, phase_name], rows[True, phase_name]
        assert replayed["cuda_graph"] is True and "cuda_graph_failed" not in replayed["warnings"]
        assert replayed["median_us"] < eager["median_us"], (phase_name, replayed, eager)


def test_an_op_that_cannot_be_captured_is_timed_eagerly_and_leaves_the_device_usable():
    x = torch.randn(1024, 1024, device=CUDA, requires_grad=True)
    syncs = Phase("forward", OpCall(lambda t: (t * t).sum().item(), (x,)), seed=0)  # .item() syncs the host
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated()
    row = GetDataObserver(CUDA, QUICK, [], cuda_graph_below_us=1e6).observe(None, ShapePoint(64, 1), syncs)
    assert row["cuda_graph"] is False and "cuda_graph_failed(" in row["warnings"]
    assert row["samples"] >= 5 and row["median_us"] > 0
    # usable afterwards: memory back, random numbers (the generator survived), and a new capture
    assert torch.cuda.memory_allocated() <= allocated + 2**20
    torch.manual_seed(1)
    first = torch.randn(4, device=CUDA)
    torch.manual_seed(1)
    assert torch.equal(first, torch.randn(4, device=CUDA))
    phase, _ = _linear_phase("forward", 8, 8, 8)
    capture_phase(phase)()


def test_dropout_under_megatrons_rng_tracker_is_captured():
    """Megatron draws attention dropout inside ``get_cuda_rng_tracker().fork()``. The tracker we install
    on a GPU is the graph-safe one (autotuner.model.runtime.seed_everything), whose generators the graph
    registers: each replay draws new numbers, as successive eager calls do."""
    from megatron.core import tensor_parallel

    from autotuner.model.runtime import graph_rng_generators, init_parallel, seed_everything

    init_parallel(CUDA)
    seed_everything(0, CUDA)
    generators = graph_rng_generators()
    assert generators

    def dropout(t: torch.Tensor) -> torch.Tensor:
        with tensor_parallel.get_cuda_rng_tracker().fork():
            return torch.nn.functional.dropout(t, p=0.5, training=True)

    replay = capture_phase(Phase("forward", OpCall(dropout, (torch.ones(4096, device=CUDA),)), 0), generators)
    replay()
    first = replay.outputs.clone()
    replay()
    torch.cuda.synchronize()
    assert not torch.equal(first, replay.outputs)
    assert bool(((replay.outputs == 0) | (replay.outputs == 2)).all())
    assert 0.4 < float((replay.outputs == 0).float().mean()) < 0.6


def test_tiny_case_on_the_gpu_with_graphs_and_functional_ops(tmp_path: Path):
    fast = ["timing.warmup=2", "timing.min_samples=3", "timing.budget_s=0.2", "progress=false"]
    overrides = ["device=cuda", "ops=[all,functional]", "timing.cuda_graph=true", "shapes.seq_len=[32]"]
    overrides.append("timing.cuda_graph_below_us=1e9")  # every phase is tried
    assert run(["case=tiny", f"hydra.run.dir={tmp_path}", *overrides, *fast]) == 0
    rows = load_rows(tmp_path / "results.jsonl")
    assert rows and all(r["status"] == "ok" and r["device"] == "cuda" for r in rows), [
        (r["op"], r["phase"], r["error"]) for r in rows if r["status"] != "ok"
    ]
    # every phase is captured (attention dropout forks Megatron's graph-safe RNG tracker) but pageable copies
    # and the loss's backward, which edits a tensor its forward saved and so cannot run twice
    eager = {(r["op"], r["phase"]): r["warnings"] for r in rows if not r["cuda_graph"]}
    expected = {("h2d_pageable", "forward"), ("d2h_pageable", "forward"), ("output_layer", "backward")}
    assert set(eager) == expected, eager
    assert "cuda_graph_failed(not_replayable)" in eager["output_layer", "backward"], eager
    by_op = {r["op"]: r for r in rows if r["phase"] == "forward"}
    for name in ("h2d_pageable", "h2d_pinned", "d2h_pageable", "d2h_pinned"):
        assert by_op[name]["gbps"] > 0
    # a pageable host copy cannot be captured (the driver stages it synchronously): not even tried
    assert by_op["h2d_pageable"]["cuda_graph"] is False and by_op["h2d_pinned"]["cuda_graph"] is True
    failed = [(r["op"], r["phase"]) for r in rows if "cuda_graph_failed" in r["warnings"]]
    assert failed == [("output_layer", "backward")], failed
    assert not any("cuda_graph_off" in r["warnings"] for r in rows)
    # bias-dropout-add without bias or dropout: its backward hands the gradient on, no kernel to time
    empty = {(r["op"], r["phase"]) for r in rows if "cuda_graph_empty" in r["warnings"]}
    assert {("self_attn_bda", "backward"), ("mlp_bda", "backward")} <= empty, empty
    assert all(phase == "backward" for _, phase in empty), empty


def test_hide_launch_keeps_the_hosts_delay_before_the_first_kernel_out_of_the_sample():
    """A call that makes the host wait 2 ms before its one small kernel: without hide_launch the GPU
    sits idle inside the events for those 2 ms (as it waits for autograd's start in a backward); with
    it, the spin queued before the start event covers the wait and the sample is the kernel's time."""
    a = torch.randn(256, 256, device=CUDA)

    def late_kernel() -> None:
        time.sleep(0.002)
        torch.mm(a, a)

    timed = {}
    for hide in (False, True):
        timer = DeviceTimer(CUDA, hide_launch=hide)
        for _ in range(3):  # the spin learns the launch time from the previous call
            timer.time_ns(late_kernel)
        timed[hide] = min(timer.time_ns(late_kernel) for _ in range(5)) / 1e3
    assert timed[False] > 1900, timed
    assert timed[True] < 500, timed


def test_an_op_the_host_issues_slower_than_the_gpu_runs_it_is_flagged_launch_bound():
    """With the launches hidden a sample is the GPU's time; the host's time per call is kept beside it,
    and a call that takes the host 2 ms to issue for a short kernel is flagged ``launch_bound``."""
    a = torch.randn(256, 256, device=CUDA)

    def late_kernel() -> None:
        time.sleep(0.002)
        torch.mm(a, a)

    policy = SamplingPolicy(warmup=2, min_samples=10, max_samples=10, budget_s=5.0)
    # one call per sample (an untimed step before each, as a backward has): a block of forward calls
    # would take the host longer to issue than the spin's ceiling covers
    columns = sample(DeviceTimer(CUDA), late_kernel, policy, prepare=lambda: None).columns()
    assert columns["median_us"] < 500 and columns["host_median_us"] > 1900, columns
    assert "launch_bound(host=" in columns["warnings"], columns
    # an op the GPU takes longer to run than the host to issue: host time below, no flag
    b = torch.randn(4096, 4096, device=CUDA)
    columns = sample(DeviceTimer(CUDA), lambda: torch.mm(b, b), policy).columns()
    assert columns["host_median_us"] < columns["median_us"], columns
    assert "launch_bound" not in columns["warnings"], columns


@pytest.mark.parametrize("case", ["tiny_moe", "tiny_mla"])
def test_moe_and_mla_ops_run_on_the_gpu_whether_or_not_transformer_engine_imports(case: str, tmp_path: Path):
    # Megatron-Core 0.16.1's router names Transformer-Engine's GEMM, unbound without it: on an H200 every
    # MoE op failed with NameError until the router's bridge covered CUDA too (autotuner.model.cpu_bridges)
    fast = [
        "timing.warmup=2",
        "timing.min_samples=3",
        "timing.budget_s=0.1",
        "progress=false",
        "report=false",
    ]
    assert run([f"case={case}", "device=cuda", f"hydra.run.dir={tmp_path}", *fast]) == 0
    rows = load_rows(tmp_path / "results.jsonl")
    assert {"router", "experts"} <= {r["op"] for r in rows}
    failed = [(r["op"], r["phase"], r["error"]) for r in rows if r["status"] not in ("ok", "skipped")]
    assert not failed, failed


def test_the_steps_time_their_ops_inside_with_cuda_events(tmp_path: Path):
    # autotuner.predict.in_step on a GPU: each span is device time between two recorded events, read after
    # the step's synchronize; the layers and the head inside the stage's forward, as on a CPU
    from autotuner.predict.in_step import IN_STEP_KEYS
    from autotuner.predict.layout import Layout
    from autotuner.predict.steps import run_steps

    layout = Layout(seq_len=32, micro_batch_size=1, global_batch_size=4, dtype="fp32")
    measured = run_steps("tiny", ["device=cuda"], layout, tmp_path / "steps.json", repeats=3, timeout_s=300)
    inside = measured.in_step(0)
    assert set(inside) == set(IN_STEP_KEYS) and all(seconds > 0 for seconds in inside.values()), inside
    parts = inside["embedding.forward"] + 2 * inside["transformer_layer.forward"]
    parts += inside["final_layernorm.forward"] + inside["output_layer.forward"]
    assert parts < 1.2 * inside["stage.forward"], inside
    assert 4 * inside["stage.forward"] < measured.forward_backward_s
    # the median step's visits: device time from an event recorded at the step's start
    (rank,) = measured.ranks
    fb = rank.forward_backward_s[measured.timeline_step]
    assert sum(1 for key, *_ in rank.timeline if key == "transformer_layer.forward") == 2 * 4
    assert all(0 <= start < end <= fb * 1.01 for _, _, start, end in rank.timeline), (fb, rank.timeline)
