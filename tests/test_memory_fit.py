"""Fit, before the first op: the peak-memory estimate by term, checked against measured peaks; the fit check
that refuses what the process cannot hold; the OOM killer named; the plan's time estimate
(autotuner.runner.memory_estimate, autotuner.runner.fit, autotuner.runner.eta, docs/memory_and_fit.md)."""

from __future__ import annotations

import gc
import re
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch

from autotuner.config import compose_config
from autotuner.main import run
from autotuner.measure.limits import MemoryLimit, resident_bytes
from autotuner.measure.memory import SavedTensorsMeter, gradient_buffers
from autotuner.results import load_rows
from autotuner.runner import Phase
from autotuner.runner.dry_run import preview
from autotuner.runner.memory_estimate import LiveStorages, Workspace, phase_peak
from autotuner.runner.spec import open_session, resolve_spec

ROOT = Path(__file__).resolve().parents[1]
QUIET = ["progress=false", "report=false"]
# A llama-shaped model at a reduced size (Llama-2-7B's head size, vocabulary and SwiGLU ratio; 1.0-1.2 GiB)
LLAMA_SHAPED = [
    "case=llama7b",
    "hf.hidden_size=512",
    "hf.intermediate_size=1408",
    "hf.num_attention_heads=4",
    "hf.num_key_value_heads=4",
    "hf.num_hidden_layers=2",
    "shapes.seq_len=[1024]",
    "shapes.micro_batch_size=[1]",
]
# Llama-2-7B's own attention at a quarter of its sequence: its s x s tensors (128 MiB each) weigh most
LLAMA_ATTENTION = ["case=llama7b", "ops=[self_attention]", "shapes.seq_len=[1024]"]
_UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}


def _size(text: str) -> float:
    number, unit = text.split()
    return float(number) * _UNITS[unit]


def test_meta_tensors_hold_what_the_real_ones_hold():
    """Each phase's peak and its terms on meta tensors (the dry run's) are those of the same phase run on
    the real model on the CPU, sorted by the same rules: the estimate's tensors are not a formula."""
    over = ["case=tiny", "shapes.seq_len=[32]", "shapes.micro_batch_size=[2]", "device=cpu"]
    costs = {(c.op, c.phase): c.memory for c in preview(resolve_spec(compose_config(over))).costs}
    spec = resolve_spec(compose_config(over))
    _, context = open_session(spec)
    point = spec.points[0]
    for op in spec.ops:  # once each first: Megatron's attention buffer is then made, as on meta
        call = op.build(context, point)
        for phase in op.phases:
            phase_peak(Phase(phase, call, 0), point.seq_len, gradient_buffers)
    for op in spec.ops:
        call = op.build(context, point)
        for phase in op.phases:
            real, meta = (
                phase_peak(Phase(phase, call, 0), point.seq_len, gradient_buffers),
                costs[(op.name, phase)],
            )
            assert meta is not None and meta.total > 0
            assert (real.gradients, real.activations, real.attention_scores, real.temporaries) == (
                meta.gradients,
                meta.activations,
                meta.attention_scores,
                meta.temporaries,
            ), (op.name, phase)
    attention = costs[("core_attention", "backward")]
    assert attention.attention_scores >= 2 * 4 * 32 * 32 * 4  # scores and probabilities, [b * heads, s, s]


def test_a_view_of_a_storage_made_before_the_phase_is_not_the_phase_s():
    """Megatron slices its attention-score buffer, made once for the process, at every call: the slice
    and an in-place op on it hold no new storage (counted, each layer of a block held the buffer again),
    while what an op makes from it does."""
    buffer = torch.empty(2**20, device="meta")  # made before, as Megatron's buffer is
    with LiveStorages() as tracker:
        scores = buffer[: 2**18].view(64, 64, 64)
        scores.mul_(2.0)
        probs = scores.softmax(-1)
    assert tracker.peak == probs.untyped_storage().nbytes() == 2**20


def test_the_activation_sensor_frees_what_its_ops_saved():
    """An op that saves its own output (exp) under the activation sensor's hooks: once the output is
    dropped its storage is freed (returned as is, the saved object held its node: a cycle nothing freed,
    so every metered forward leaked, 640 MiB of a llama-shaped block's)."""
    x = torch.randn(64, requires_grad=True)
    with SavedTensorsMeter() as meter:
        y = torch.exp(x)
    freed = []
    weakref.finalize(y.untyped_storage(), freed.append, True)
    assert meter.bytes == y.untyped_storage().nbytes()
    del y
    gc.collect()
    assert freed == [True]


def test_dry_run_shows_each_point_s_peak_by_term(capsys):
    assert run(["case=tiny", "dry_run=true", *QUIET]) == 0
    out = capsys.readouterr().out
    for point in ("s32_b2", "s64_b2"):
        assert re.search(rf"^{point}: peak [\d.]+ \w+ at \w+ (forward|backward), of which$", out, re.M), out
    for term in ("weights", "gradients", "activations", "attention scores", "temporaries", "optimizer"):
        assert re.search(rf"^ +[\d.]+ \w+  {term}: ", out, re.M), term
    # the runtime is this process's resident set: a pytest worker late in the suite holds over a GiB
    assert re.search(r"^ +[\d.]+ \w+  workspace: runtime [\d.]+ [KMG]iB", out, re.M)
    assert "fit check: every row fits in" in out


@pytest.mark.slow
def test_a_memory_limit_of_one_s_own_is_checked_against(capsys):
    """``memory_limit_gib`` below the device's limit is the limit (named as the setting); above it, the
    device's stays; not a positive number: one line, exit 2."""
    assert run(["case=tiny", "dry_run=true", "memory_limit_gib=0.25", *QUIET]) == 0
    out = capsys.readouterr().out
    assert re.search(
        r"^fit check: \d+ of \d+ rows do not fit in memory .*limit 0\.25 GiB, memory_limit_gib=0\.25",
        out,
        re.M,
    )
    assert re.search(r"^transformer_block +backward +s64_b2 .* refused$", out, re.M), out
    assert run(["case=tiny", "dry_run=true", "memory_limit_gib=100000", *QUIET]) == 0
    assert "fit check: every row fits in" in capsys.readouterr().out
    assert run(["case=tiny", "dry_run=true", "memory_limit_gib=0", *QUIET]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line == (
        "autotuner: error: memory_limit_gib=0.0 is no memory: give a positive number of GiB, or leave it out "
        "for what the device has"
    )


def _peak_rss_of(args: list[str]) -> int:
    """Run ``python -m autotuner.main *args`` in a process of its own; its highest resident set. Started
    by a small Python process, not by this one: a child's ru_maxrss keeps the resident set it had before
    its exec, a copy of its parent's (a pytest worker late in the suite holds more than the run)."""
    waiter = (
        "import os, subprocess, sys; p = subprocess.Popen(sys.argv[1:], stdout=subprocess.DEVNULL); "
        "_, status, usage = os.wait4(p.pid, 0); print(os.waitstatus_to_exitcode(status), usage.ru_maxrss)"
    )
    command = [sys.executable, "-c", waiter, sys.executable, "-m", "autotuner.main", *args]
    said = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    assert said[0] == "0", said
    return int(said[1]) * 1024


@pytest.mark.slow
@pytest.mark.parametrize(
    "overrides",
    [["case=tiny", "shapes.seq_len=[64]", "shapes.micro_batch_size=[2]"], LLAMA_SHAPED, LLAMA_ATTENTION],
    ids=["tiny", "llama_shaped", "llama_attention"],
)
def test_the_estimate_is_within_a_quarter_of_the_measured_peak(overrides: list[str], tmp_path: Path):
    """The dry run's peak of a point against the highest resident set of a process that measures that
    point (every op, get_data's defaults but fewer samples: the counts change how long, not what is
    alive at once); and the run's own estimate, recorded in its rows, against the same."""
    dry = subprocess.run(
        [sys.executable, "-m", "autotuner.main", *overrides, "dry_run=true"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    (said,) = re.findall(r"^s\d+_b\d+: peak ([\d.]+ \w+) at ", dry.stdout, re.M)
    few = ["timing.warmup=1", "timing.min_samples=2", "timing.max_samples=3", "timing.budget_s=0.1"]
    measured = _peak_rss_of([*overrides, *few, *QUIET, f"hydra.run.dir={tmp_path}"])
    print(f"estimated {said}, measured {measured / 2**20:.0f} MiB")
    assert 0.75 <= _size(said) / measured <= 1.25
    rows = load_rows(tmp_path / "results.jsonl")
    assert all(r["status"] == "ok" for r in rows)
    assert 0.75 <= max(r["estimated_peak_bytes"] for r in rows) / measured <= 1.25


def _limit_between(spec_overrides: list[str], fits: set[str], refused: set[str]) -> int:
    """A margin over the runtime that the rows of ``fits`` stay under and those of ``refused`` exceed."""
    seen = preview(resolve_spec(compose_config(spec_overrides)), Workspace.of_process(torch.device("cpu")))
    rest = {}
    for cost, guess in zip(seen.costs, seen.estimates, strict=True):
        rest.setdefault(cost.op, []).append(guess.total - guess.runtime)
    low, high = max(max(rest[op]) for op in fits), min(min(rest[op]) for op in refused)
    assert low < high, (low, high)
    return (low + high) // 2


@pytest.mark.slow
def test_rows_over_the_limit_are_refused_with_both_numbers_and_what_would_fit(tmp_path, monkeypatch, capsys):
    """The limit lowered at its one seam (autotuner.runner.fit.memory_limit: this process's resident set
    plus a margin) between the norm's estimate and the attention's: the attention's rows are refused
    before they run, with the estimate and the limit in the row, one line says what would fit, the
    summary says which; ``run_unfit=true`` runs them."""
    import autotuner.runner.fit as fit

    over = [
        "case=tiny",
        "ops=[input_layernorm,core_attention]",
        "shapes.seq_len=[256]",
        "shapes.micro_batch_size=[2]",
    ]
    margin = _limit_between([*over, "device=cpu"], {"input_layernorm"}, {"core_attention"})
    monkeypatch.setattr(
        fit, "memory_limit", lambda device: MemoryLimit(resident_bytes() + margin, "a test's")
    )
    few = ["timing.min_samples=2", "timing.max_samples=3", *QUIET]
    assert run([*over, *few, f"hydra.run.dir={tmp_path / 'refused'}"]) == 0
    captured = capsys.readouterr()
    rows = {(r["op"], r["phase"]): r for r in load_rows(tmp_path / "refused" / "results.jsonl")}
    assert {k: r["status"] for k, r in rows.items()} == {
        ("input_layernorm", "forward"): "ok",
        ("input_layernorm", "backward"): "ok",
        ("core_attention", "forward"): "refused",
        ("core_attention", "backward"): "refused",
    }
    for row in rows.values():
        assert row["memory_limit_bytes"] > 0 and row["estimated_peak_bytes"] > 0
        assert (row["estimated_peak_bytes"] > row["memory_limit_bytes"]) == (row["status"] == "refused")
    error = rows[("core_attention", "backward")]["error"]
    assert re.fullmatch(
        r"does not fit in memory: estimated [\d.]+ GiB, limit [\d.]+ GiB \(a test's\); .*", error
    )
    (line,) = [x for x in captured.err.splitlines() if "do not fit in memory" in x]
    assert line.startswith(
        "autotuner: 2 of 4 rows do not fit in memory and are refused (core_attention at s256_b2"
    )
    assert re.search(
        r"would fit: shapes\.seq_len=\[\d+\] or the other 1 ops as they are \(ops=\[input_layernorm\]\)", line
    )
    assert "2 refused: estimated over the memory limit (core_attention s256_b2" in captured.out
    # the shorter sequence it names fits: its rows all run under the same limit
    shorter = re.search(r"shapes\.seq_len=\[(\d+)\]", line)[1]
    assert run([*over, f"shapes.seq_len=[{shorter}]", *few, f"hydra.run.dir={tmp_path / 'shorter'}"]) == 0
    assert {r["status"] for r in load_rows(tmp_path / "shorter" / "results.jsonl")} == {"ok"}
    assert run([*over, *few, "run_unfit=true", f"hydra.run.dir={tmp_path / 'anyway'}"]) == 0
    assert {r["status"] for r in load_rows(tmp_path / "anyway" / "results.jsonl")} == {"ok"}


@pytest.mark.slow
def test_a_model_too_large_to_build_refuses_every_row_and_builds_nothing(tmp_path, capsys):
    """Against the machine's real limit: an embedding of 2^31 words of 64 floats (512 GiB) fits nowhere,
    so every row is refused and no weight is allocated (the run ends in seconds, its resident set small)."""
    before = resident_bytes()
    over = ["case=tiny", "hf.vocab_size=2147483648", "ops=[embedding,linear_qkv]", "shapes.seq_len=[32]"]
    assert run([*over, *QUIET, f"hydra.run.dir={tmp_path}"]) == 0
    err = capsys.readouterr().err
    assert "building the model parts alone takes" in err
    rows = load_rows(tmp_path / "results.jsonl")
    assert {r["status"] for r in rows} == {"refused"} and len(rows) == 4
    assert resident_bytes() - before < 2**30


def _agree(rank: int, refused: list[list[list[str]]], port: int, out: Path) -> None:
    import torch.distributed as dist

    from autotuner.runner.fit import FitCheck

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    keys = [("s32_b1", "mlp", "forward"), ("s32_b1", "mlp", "backward"), ("s64_b1", "mlp", "forward")]
    check = FitCheck(MemoryLimit(1, "test"), refused={tuple(k) for k in refused[rank]})
    check.agree(keys, torch.device("cpu"))
    (out / f"rank{rank}").write_text(repr(sorted(check.refused)))
    dist.destroy_process_group()


@pytest.mark.slow
def test_ranks_refuse_what_any_rank_refuses(tmp_path):
    """Two processes of one gloo group, each refusing another row: both then refuse both (a row one rank
    ran alone would wait in its collectives for ever)."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    refused = [[["s32_b1", "mlp", "forward"]], [["s64_b1", "mlp", "forward"]]]
    mp.spawn(_agree, args=(refused, port, tmp_path), nprocs=2)
    both = repr([("s32_b1", "mlp", "forward"), ("s64_b1", "mlp", "forward")])
    assert (tmp_path / "rank0").read_text() == (tmp_path / "rank1").read_text() == both


@pytest.mark.nsys
def test_a_worker_killed_for_memory_is_named_and_its_larger_points_skipped(nsys_bin, tmp_path, monkeypatch):
    """A real SIGKILL of the nsys worker once a row is done, with the kernel's OOM-kill count read as
    risen (the one faked read: the real OOM killer is not set on a shared machine): the row it died in
    says "out of memory (estimated X GiB, limit Y GiB)" from the worker's own fit check, the same op at
    the larger point is skipped with that reason, and no row names a signal number alone."""
    import autotuner.launchers.nsys as nsys_launcher
    from tests.test_nsys_launcher import launch_killed_after

    reads = iter(range(100))
    monkeypatch.setattr(nsys_launcher, "oom_kills", lambda: next(reads))  # rises between the two reads
    run_dir = tmp_path / "run"
    result = launch_killed_after(nsys_bin, run_dir, 1, "launcher.iterations=20")
    assert "the kernel's out-of-memory killer" in result.stderr
    rows = load_rows(run_dir / "results.jsonl")
    oom = re.compile(r"out of memory \(estimated [\d.]+ GiB, limit [\d.]+ GiB\)")
    (dead,) = [r for r in rows if r["status"] == "failed" and oom.fullmatch(r["error"])]
    phases = ("forward", "backward") if dead["phase"] == "forward" else ("backward",)
    larger = [
        r for r in rows if r["op"] == dead["op"] and r["seq_len"] > dead["seq_len"] and r["phase"] in phases
    ]
    assert larger and all(r["status"] == "skipped" and oom.match(r["error"]) for r in larger)
    assert all("at " + dead["point"] in r["error"] for r in larger)
    after = [r for r in rows[rows.index(dead) + 1 :] if r not in larger and r["status"] != "ok"]
    assert all(oom.search(r["error"]) and "died before measuring it" in r["error"] for r in after)


@pytest.mark.gpu
def test_the_gpu_estimate_is_within_a_quarter_of_max_memory_allocated(tmp_path):
    """On a GPU the estimate's runtime is 0 and it is compared with the allocator's peak over the whole
    point (every op of the llama-shaped model), the bytes held before the run added to both."""
    over = [*LLAMA_SHAPED, "device=cuda"]
    seen = preview(
        resolve_spec(compose_config(over)), Workspace.of(compose_config(over), torch.device("cuda"))
    )
    estimate = max(e.total for e in seen.estimates if e is not None)
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    few = ["timing.min_samples=2", "timing.max_samples=3", "timing.budget_s=0.1"]
    assert run([*over, *few, *QUIET, f"hydra.run.dir={tmp_path}"]) == 0
    measured = torch.cuda.max_memory_allocated()
    print(
        f"estimated {estimate / 2**20:.0f} MiB + {held / 2**20:.0f} held, measured {measured / 2**20:.0f} MiB"
    )
    assert 0.75 <= (estimate + held) / measured <= 1.25
