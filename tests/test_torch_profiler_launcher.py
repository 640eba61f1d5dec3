"""The torch_profiler launcher on CPU: files per (op, point), results rows, bad input, the same rows as
get_data (their times' agreement: benchmarks/profiler_agreement.py). The CLI runs in this process
(autotuner.main.run), so Megatron is imported once."""

from __future__ import annotations

import csv
import gzip
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from autotuner.launchers import profiler_files
from autotuner.launchers.torch_profiler import range_times_ns
from autotuner.main import run
from autotuner.ops.naming import parse_range
from autotuner.results import COLUMNS
from benchmarks import profiler_agreement
from tests.conftest import dense_model_ops

POINTS = ("s16_b1",)  # one point: each (op, point) costs two profiler sessions and their exports
ACTIVE = 2
# Small enough that the layer-sized traces are compressed and the single-op ones are not.
COMPRESS_OVER = 5_000_000


def _rows(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "results.jsonl").read_text().splitlines() if line]


def _load_trace(path: Path) -> dict[str, Any]:
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rt") as handle:
        return json.load(handle)


def _trace_file(folder: Path) -> Path:
    traces = [p for p in folder.iterdir() if p.name.endswith((".json", ".json.gz"))]
    assert len(traces) == 1, f"{folder} should hold exactly one trace (HTA reads each as a rank): {traces}"
    return traces[0]


@pytest.fixture(scope="module")
def profiled(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One run of case=tiny, every op, a small shape point; its run directory."""
    run_dir = tmp_path_factory.mktemp("torch_profiler")
    code = run(
        [
            "case=tiny",
            "launcher=torch_profiler",
            "shapes.seq_len=[16]",
            "shapes.micro_batch_size=[1]",
            "launcher.warmup=1",
            f"launcher.active={ACTIVE}",
            f"launcher.compress_over_bytes={COMPRESS_OVER}",
            "launcher.with_stack=true",  # the stack files are tested too
            f"hydra.run.dir={run_dir}",
            "progress=false",
        ]
    )
    assert code == 0
    return run_dir


@pytest.mark.slow
def test_the_defaults_write_under_50_mb_for_the_tiny_case_and_warn_on_no_row(tmp_path: Path, capsys) -> None:
    """At the default settings the whole tiny plan writes at most 50 MB: its largest op (transformer_block,
    the model's layers) at the case's own points, times every (op, point) of the plan, stays under it.
    Traces are gzipped (Perfetto, TensorBoard and HTA read them so) and no row warns: the fixed count of
    samples is one note naming the setting."""
    assert (
        run(
            [
                "case=tiny",
                "launcher=torch_profiler",
                "ops=[transformer_block]",
                "progress=false",
                "report=false",
                f"hydra.run.dir={tmp_path}",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    folders = [p for p in (tmp_path / "profiles").glob("*/transformer_block") if p.is_dir()]
    largest = max(sum(f.stat().st_size for f in folder.iterdir()) for folder in folders)
    plan = len(dense_model_ops()) * len(folders)  # every op of the tiny case at each of its points
    assert largest * plan <= 50e6, f"{largest * plan / 1e6:.0f} MB"
    assert all(_trace_file(folder).name.endswith(".json.gz") for folder in folders)
    _load_trace(_trace_file(folders[0]))  # a gzipped trace as Perfetto and HTA read it
    assert [r["warnings"] for r in _rows(tmp_path)] == [""] * 2 * len(folders)
    assert "! rows with warnings" not in out and "launcher.active" in out


@pytest.fixture(scope="module")
def op_names() -> list[str]:
    return list(dense_model_ops())  # what ops=[all] runs on case=tiny


@pytest.mark.slow
def test_results_rows_like_get_data(profiled: Path, op_names: list[str]) -> None:
    rows = _rows(profiled)
    assert [list(r) for r in rows] == [COLUMNS] * len(rows)
    with open(profiled / "results.csv", newline="") as handle:
        assert next(csv.reader(handle)) == COLUMNS
    by_key = {(r["op"], r["phase"], r["point"]): r for r in rows}
    for op in op_names:
        for phase in ("forward", "backward"):
            for point in POINTS:
                row = by_key[(op, phase, point)]
                assert row["status"] == "ok", row
                assert row["launcher"] == "torch_profiler" and row["samples"] == ACTIVE
                assert 0 < row["min_us"] <= row["median_us"] and row["stop_reason"] == "torch_profiler"
                assert row["flops"] is not None and row["weight_bytes"] is not None


@pytest.mark.slow
def test_trace_per_op_and_point_holds_labelled_ranges_with_aten_inside(
    profiled: Path, op_names: list[str]
) -> None:
    compressed = set()
    for point in POINTS:
        for op in op_names:
            path = _trace_file(profiled / "profiles" / point / op)
            if path.name.endswith(".gz"):
                compressed.add(op)
            trace = _load_trace(path)
            assert trace["distributedInfo"]["rank"] == 0
            events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
            aten = [e for e in events if e.get("cat") == "cpu_op" and e["name"].startswith("aten::")]
            for phase in ("forward", "backward"):
                for i in range(ACTIVE):
                    name = f"{op}.{phase} [{point}] #{i}"
                    ranges = [e for e in events if e.get("cat") == "user_annotation" and e["name"] == name]
                    assert len(ranges) == 1, f"{path.name}: {name}"
                    r = ranges[0]
                    inside = [
                        e
                        for e in aten
                        if e["tid"] == r["tid"]
                        and r["ts"] <= e["ts"]
                        and e["ts"] + e["dur"] <= r["ts"] + r["dur"]
                    ]
                    assert inside, f"{path.name}: no aten operator inside {name}"
    # large traces are gzipped, small ones are not
    assert {"transformer_block", "transformer_layer"} <= compressed < set(op_names)


@pytest.mark.slow
def test_stack_and_table_files(profiled: Path, op_names: list[str]) -> None:
    for point in POINTS:
        for op in op_names:
            folder, stem = profiled / "profiles" / point / op, f"{op}.{point}"
            stacks = (folder / f"{stem}.stacks.cpu.txt").read_text().splitlines()
            assert stacks, f"{stem}: empty stack file"
            frames, value = stacks[0].rsplit(" ", 1)
            assert frames and int(value) > 0  # folded stacks: "a;b;c <self CPU us>"
            with open(folder / f"{stem}.ops.csv", newline="") as handle:
                table = list(csv.DictReader(handle))
            assert any(r["name"].startswith("aten::") and int(r["calls"]) > 0 for r in table)
            assert "Self CPU" in (folder / f"{stem}.ops.txt").read_text()
            assert not [p for p in folder.iterdir() if p.name.endswith(".tmp")]


@pytest.mark.slow
def test_holistic_trace_analysis_loads_the_traces(profiled: Path) -> None:
    """HTA reads our traces (CPU only: its GPU analyses need kernels, so: loading and finding ranges)."""
    from hta.trace_analysis import TraceAnalysis

    for op in ("linear_qkv", "transformer_layer"):  # a plain and a gzipped trace
        folder = profiled / "profiles" / POINTS[0] / op
        analysis = TraceAnalysis(trace_dir=str(folder))
        symbols = analysis.t.symbol_table
        names = {
            f"{op}.{phase} [{POINTS[0]}] #{i}" for phase in ("forward", "backward") for i in range(ACTIVE)
        }
        assert names <= set(symbols.sym_table)
        # HTA keeps the events of complete ProfilerSteps only (it drops the last one): step #0 is there
        in_frame = set(analysis.t.get_trace(0)["name"])
        for phase in ("forward", "backward"):
            assert symbols.sym_index[f"{op}.{phase} [{POINTS[0]}] #0"] in in_frame


@pytest.mark.slow
def test_resume_measures_a_backward_row_alone(tmp_path: Path) -> None:
    """With the forward row done, the sessions run for the backward row (and the forward row stays)."""
    argv = [
        "case=tiny",
        "launcher=torch_profiler",
        "ops=[linear_qkv]",
        "shapes.seq_len=[16]",
        "shapes.micro_batch_size=[1]",
        "launcher.warmup=1",
        f"launcher.active={ACTIVE}",
        "launcher.with_stack=false",
        f"hydra.run.dir={tmp_path}",
        "progress=false",
    ]
    assert run(argv) == 0
    forward, backward = _rows(tmp_path)
    backward["status"] = "failed"  # measured again on resume
    (tmp_path / "results.jsonl").write_text(json.dumps(forward) + "\n" + json.dumps(backward) + "\n")
    assert run([*argv, "resume=true"]) == 0
    rows = _rows(tmp_path)
    assert rows[0] == forward
    assert rows[1]["phase"] == "backward" and rows[1]["status"] == "ok" and rows[1]["samples"] == ACTIVE


def test_own_range_only(op_names: list[str]) -> None:
    """A row's time is the op's own range: not a sub-op's, another point's, or a warm-up range; on a GPU
    the kernels, memsets and copies inside its GPU-side span."""

    def event(name: str, start: float, end: float, cpu: bool = True, range_: bool = True) -> SimpleNamespace:
        device = torch.autograd.DeviceType.CPU if cpu else torch.autograd.DeviceType.CUDA
        return SimpleNamespace(
            name=name,
            is_user_annotation=range_,
            device_type=device,
            time_range=SimpleNamespace(start=start, end=end),
        )

    events = [
        event("transformer_layer.forward [s16_b1] #w0", 0, 50),
        event("transformer_layer.forward [s16_b1] #0", 100, 110),
        event("linear_qkv.forward [s16_b1] #0", 101, 102),
        event("transformer_layer.forward [s32_b1] #0", 200, 299),
        event("transformer_layer.backward [s16_b1] #0", 120, 150),
        event("transformer_layer.backward [s16_b1] #0", 130, 160, cpu=False),
        event("ProfilerStep#3", 0, 1000),
        # the GPU's work: two kernels and a memset inside the backward's GPU span, idle gaps between
        # them, and a kernel of another range after it
        event("ampere_sgemm", 130, 140, cpu=False, range_=False),
        event("Memset (Device)", 141, 142, cpu=False, range_=False),
        event("elementwise_kernel", 150, 160, cpu=False, range_=False),
        event("elementwise_kernel", 170, 180, cpu=False, range_=False),
    ]
    assert range_times_ns(events, "transformer_layer", "s16_b1", cuda=False) == {
        "forward": {0: 10_000},
        "backward": {0: 30_000},
    }
    # on a GPU the busy time inside the span (21 us of work), not the span (30 us)
    assert range_times_ns(events, "transformer_layer", "s16_b1", cuda=True) == {"backward": {0: 21_000}}
    assert parse_range("transformer_layer.forward [s16_b1] #w0").warmup


class _FakeProfiler:
    def __init__(self, text: str, fail: bool = False) -> None:
        self.text, self.fail = text, fail

    def export_chrome_trace(self, path: str) -> None:
        Path(path).write_text(self.text[: len(self.text) // 2] if self.fail else self.text)
        if self.fail:
            raise OSError("No space left on device")


def test_trace_written_whole_or_not_at_all(tmp_path: Path) -> None:
    body = '{\n  "schemaVersion": 1,\n  "traceEvents": [' + ",".join(['{"ph": "i"}'] * 200) + "]\n}"
    good = profiler_files.write_trace(_FakeProfiler(body), tmp_path, "op.s1_b1", 3, 1 << 30)
    assert good.name == "op.s1_b1.pt.trace.json"
    assert json.loads(good.read_text())["distributedInfo"] == {"rank": 3}
    with pytest.raises(OSError):
        profiler_files.write_trace(_FakeProfiler(body, fail=True), tmp_path, "op.s1_b1", 3, 1 << 30)
    assert sorted(p.name for p in tmp_path.iterdir()) == [good.name]  # the earlier trace, untouched
    assert json.loads(good.read_text())["schemaVersion"] == 1
    packed = profiler_files.write_trace(_FakeProfiler(body), tmp_path, "op.s1_b1", 3, 100)
    assert sorted(p.name for p in tmp_path.iterdir()) == [packed.name] == ["op.s1_b1.pt.trace.json.gz"]
    assert _load_trace(packed)["distributedInfo"] == {"rank": 3}


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("launcher.active=0", "launcher.active=0"),
        ("launcher.warmup=-1", "launcher.warmup=-1"),
        ("launcher.memory_snapshot=true", "memory_snapshot"),
        ("launcher.output_dir={blocker}/profiles", "not writable"),
    ],
)
def test_bad_input_is_one_line_and_exit_2_before_profiling(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], override: str, message: str
) -> None:
    # Root passes every permission check, so a directory cannot be made unwritable with chmod here: a
    # path through a regular file fails for root too (ENOTDIR).
    blocker = tmp_path / "a-regular-file"
    blocker.write_text("")
    run_dir = tmp_path / "run"
    argv = ["case=tiny", "launcher=torch_profiler", "ops=[linear_qkv]", override.format(blocker=blocker)]
    code = run([*argv, f"hydra.run.dir={run_dir}", "progress=false", "device=cpu"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and err[0].startswith("autotuner: error:") and message in err[0], err
    assert not (run_dir / "results.jsonl").exists() and not (run_dir / "profiles").exists()


@pytest.mark.slow
def test_both_launchers_give_the_agreement_benchmarks_rows(tmp_path: Path) -> None:
    """One small round of benchmarks/profiler_agreement.py (which compares the two launchers' times,
    too noisy on a busy machine for a test): each launcher gives one row per (op, phase), on one intra-op
    thread, with the samples asked for and ordered statistics."""
    threads = torch.get_num_threads()
    rows = profiler_agreement.measure(1, tmp_path, seq_len=16, micro_batch=1, samples=3)
    assert torch.get_num_threads() == threads  # timing.threads=1 is undone for the rest of the process
    for launcher in ("get_data", "torch_profiler"):
        assert {(op, phase) for name, op, phase in rows if name == launcher} == {
            (op, phase) for op in profiler_agreement.OPS for phase in ("forward", "backward")
        }
    for (launcher, *_), [row] in rows.items():  # one round: one row each
        assert row["status"] == "ok" and row["launcher"] == launcher, row
        assert row["num_threads"] == 1 and row["samples"] == 3
        assert 0 < row["min_us"] <= row["median_us"]


@pytest.mark.slow
def test_an_op_without_backward_gets_a_forward_row(tmp_path: Path) -> None:
    """The functional ops have no backward: their sessions run the forward alone."""
    argv = [
        "case=tiny",
        "launcher=torch_profiler",
        "ops=[copy]",
        "shapes.seq_len=[16]",
        "shapes.micro_batch_size=[1]",
        "launcher.warmup=1",
        f"launcher.active={ACTIVE}",
        "launcher.with_stack=false",
        f"hydra.run.dir={tmp_path}",
        "progress=false",
    ]
    assert run(argv) == 0
    (row,) = _rows(tmp_path)
    assert (row["op"], row["phase"], row["status"], row["samples"]) == ("copy", "forward", "ok", ACTIVE)
