"""Tensor parallelism under real torchrun processes (gloo on CPU)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from autotuner.main import run
from autotuner.results import load_rows, merge_ranks

REPO = Path(__file__).resolve().parents[1]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
SMALL = ["shapes.seq_len=[16]", "shapes.micro_batch_size=[1]", "progress=false", "report=false"]


def _env() -> dict[str, str]:
    # pytest may run inside a torchrun-like environment; the children must start clean
    return {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}


@pytest.mark.torchrun
@pytest.mark.slow
def test_sharded_ops_match_the_unsharded_ones(tmp_path):
    """TP=2 outputs (column-parallel ones gathered) equal TP=1 outputs on the same inputs and weights."""
    script = str(REPO / "tests" / "tp_reference.py")
    one, two = tmp_path / "tp1.pt", tmp_path / "tp2.pt"
    subprocess.run([sys.executable, script, str(one), "1"], check=True, cwd=REPO, env=_env(), timeout=300)
    subprocess.run([*TORCHRUN, script, str(two), "2"], check=True, cwd=REPO, env=_env(), timeout=300)
    reference, sharded = torch.load(one), torch.load(two)
    assert set(reference) == {"linear_qkv", "self_attention", "mlp", "transformer_layer"}
    for name, expected in reference.items():
        torch.testing.assert_close(sharded[name], expected, rtol=0, atol=1e-5, msg=name)


# The default timing settings: a test that pins them (max_samples) would hide a rank leaving the sampling
# loop early, which deadlocks the ranks in the op's collectives.
TP_ARGS = ["case=tiny", "tf.tensor_model_parallel_size=2", "ops=[linear_qkv,linear_proj]"]
WATCHDOG_S = 300  # a deadlock ends here, not at CI's limit


@pytest.fixture(scope="module")
def tp_run(tmp_path_factory) -> Path:
    """A TP=2 get_data run under torchrun, shared by the tests below."""
    run_dir = tmp_path_factory.mktemp("tp2")
    cmd = [*TORCHRUN, "-m", "autotuner.main", *TP_ARGS, f"hydra.run.dir={run_dir}", *SMALL]
    proc = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=WATCHDOG_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir


def _assert_ranks_sampled_alike(rows: list[dict]) -> None:
    """Every rank took the same samples, blocks and stop for each (op, phase, point): they called the op
    equally often, as its collectives need."""
    by_key: dict[tuple, list[dict]] = {}
    for row in rows:
        if row["rank"] != "max":
            by_key.setdefault((row["op"], row["phase"], row["point"]), []).append(row)
    assert by_key
    for key, per_rank in by_key.items():
        assert sorted(r["rank"] for r in per_rank) == [0, 1], key
        assert all(r["status"] == "ok" for r in per_rank), (key, [r.get("error") for r in per_rank])
        decided = {(r["samples"], r["calls_per_sample"], r["stop_reason"]) for r in per_rank}
        assert len(decided) == 1, (key, decided)


@pytest.mark.torchrun
@pytest.mark.slow
def test_tensor_parallel_ranks_agree_on_sampling_with_the_default_timing(tp_run):
    _assert_ranks_sampled_alike(load_rows(tp_run / "results.jsonl"))


@pytest.mark.torchrun
@pytest.mark.slow
def test_a_noisy_rank_does_not_deadlock_the_default_sampler(tmp_path):
    """Rank 1 shares its interpreter with a spinning thread (tests/noisy_rank.py), so alone it would stop
    sampling on another rule or count than rank 0: the issue's command, default timing, with a watchdog."""
    # a column- and a row-parallel GEMM and the attention block whole (its all-reduce inside)
    ops = "ops=[linear_qkv,linear_fc2,self_attention]"
    args = ["case=tiny", "tf.tensor_model_parallel_size=2", ops, f"hydra.run.dir={tmp_path}", *SMALL]
    cmd = [*TORCHRUN, str(REPO / "tests" / "noisy_rank.py"), *args]
    proc = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=WATCHDOG_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = load_rows(tmp_path / "results.jsonl")
    assert len([r for r in rows if r["rank"] == "max"]) == 6
    _assert_ranks_sampled_alike(rows)


@pytest.mark.torchrun
@pytest.mark.slow
def test_torch_profiler_under_torchrun_with_its_defaults(tmp_path):
    args = [*TP_ARGS, "launcher=torch_profiler", f"hydra.run.dir={tmp_path}", *SMALL]
    cmd = [*TORCHRUN, str(REPO / "tests" / "noisy_rank.py"), *args]
    proc = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=WATCHDOG_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = load_rows(tmp_path / "results.jsonl")
    assert {(r["op"], r["phase"], r["rank"]) for r in rows} == {
        (op, ph, rank)
        for op in ("linear_qkv", "linear_proj")
        for ph in ("forward", "backward")
        for rank in (0, 1, "max")
    }
    _assert_ranks_sampled_alike(rows)
    # a trace per rank
    assert len(list(tmp_path.glob("profiles/*/linear_qkv/*.rank1.pt.trace.json*"))) == 1


def test_the_merged_row_times_the_slowest_rank_and_holds_the_fullest_ranks_memory():
    """Under expert parallelism the rank whose experts got more tokens saves more, and need not be the
    slower one: the merged row's memory columns are the largest over the ranks, its times the slowest's."""

    def row(rank: int, median_us: float, activation_bytes: int, peak_bytes: int, status: str = "ok") -> dict:
        return {
            "case": "tiny_moe",
            "op": "transformer_layer",
            "phase": "forward",
            "point": "s128_b1",
            "rank": rank,
            "status": status,
            "median_us": median_us,
            "weight_bytes": 444928,
            "activation_bytes": activation_bytes,
            "peak_bytes": peak_bytes,
        }

    fuller, slower = row(0, 900.0, 1_596_284, 1_783_172), row(1, 1000.0, 1_422_604, 1_596_180)
    top = merge_ranks([[fuller], [slower]])[-1]
    assert (top["rank"], top["median_us"]) == ("max", 1000.0)
    assert (top["activation_bytes"], top["peak_bytes"], top["weight_bytes"]) == (1_596_284, 1_783_172, 444928)
    # a failed rank's row stands for the op, as it was
    failed = row(1, None, None, None, status="failed")
    top = merge_ranks([[fuller], [failed]])[-1]
    assert (top["status"], top["activation_bytes"]) == ("failed", None)


@pytest.mark.torchrun
@pytest.mark.slow
def test_torchrun_results_hold_every_rank_and_the_cross_rank_max(tp_run):
    tmp_path = tp_run
    rows = load_rows(tmp_path / "results.jsonl")
    keys = {(r["op"], r["phase"], r["rank"]) for r in rows}
    assert keys == {
        (op, ph, rank)
        for op in ("linear_qkv", "linear_proj")
        for ph in ("forward", "backward")
        for rank in (0, 1, "max")
    }
    assert all(r["status"] == "ok" and r["tensor_parallel"] == 2 for r in rows)
    for op in ("linear_qkv", "linear_proj"):
        for phase in ("forward", "backward"):
            per_rank = [r for r in rows if r["op"] == op and r["phase"] == phase]
            top = next(r for r in per_rank if r["rank"] == "max")
            assert top["median_us"] == max(r["median_us"] for r in per_rank if r["rank"] != "max")
    # each rank holds half of linear_qkv's weight
    qkv = next(r for r in rows if r["op"] == "linear_qkv" and r["rank"] == 0)
    assert qkv["weight_bytes"] == 64 * 128 * 4 // 2
    assert (tmp_path / "results.rank0.jsonl").exists() and (tmp_path / "results.rank1.jsonl").exists()


@pytest.mark.torchrun
def test_a_failing_rank_fails_the_job_with_its_error_not_a_hang(tmp_path):
    (tmp_path / "results.rank1.jsonl").mkdir()  # rank 1 cannot write its results: a real fault on one rank
    args = [
        "case=tiny",
        "tf.tensor_model_parallel_size=2",
        "ops=[linear_proj]",
        f"hydra.run.dir={tmp_path}",
        *SMALL,
    ]
    proc = subprocess.run(
        [*TORCHRUN, "-m", "autotuner.main", *args],
        cwd=REPO,
        env={**_env(), "AUTOTUNER_DIST_TIMEOUT_S": "30"},  # the peer blocked in a collective gives up
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode != 0
    assert "results.rank1.jsonl" in proc.stderr and "rank      : 1" in proc.stderr


@pytest.mark.parametrize(
    "overrides, message",
    [
        # (without torchrun a TP=2 job runs one emulated rank: tests/test_emulation.py)
        (["tf.tensor_model_parallel_size=3"], "does not divide"),
    ],
)
def test_parallel_settings_this_job_cannot_run_are_refused_up_front(overrides, message, capsys, tmp_path):
    assert run(["case=tiny", f"hydra.run.dir={tmp_path}", *overrides]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


@pytest.mark.torchrun
@pytest.mark.slow
def test_the_tools_read_a_job_stopped_before_its_ranks_were_merged(tp_run, tmp_path, capsys):
    """A torchrun job stopped by a signal ends at once, before rank 0 merges: its folder holds each rank's
    results.rank<N>.jsonl and no results.jsonl. compare, report and predict merge them as the job would
    have, over the rows every rank has."""
    from autotuner.compare import load_run as compare_load
    from autotuner.predict.prediction import load_runs
    from autotuner.report.data import load_run as report_load

    for name in ("results.rank0.jsonl", "results.rank1.jsonl", "environment.json"):
        shutil.copy(tp_run / name, tmp_path / name)
    merged = load_rows(tp_run / "results.jsonl")
    assert compare_load(tmp_path)["rows"] == merged
    assert report_load(tmp_path).rows == merged
    # the predictor's rows carry where they came from (run_dir, run_processes, ...) besides
    assert [
        {k: v for k, v in r.items() if not k.startswith("run_")} for r in load_runs([tmp_path]).rows
    ] == merged
    # rank 1 stopped a row before rank 0: that row is left out on both, not reported from rank 0 alone
    rank1 = tmp_path / "results.rank1.jsonl"
    rank1.write_text("\n".join(rank1.read_text().splitlines()[:-1]) + "\n")
    lost = load_rows(tp_run / "results.rank1.jsonl")[-1]
    kept = compare_load(tmp_path)["rows"]
    assert len(kept) == len(merged) - 3  # the row on each rank, and its rank="max" row
    assert all((r["op"], r["phase"], r["point"]) != (lost["op"], lost["phase"], lost["point"]) for r in kept)


@pytest.mark.torchrun
@pytest.mark.slow
def test_a_resume_with_another_process_count_names_the_one_it_ran_with(tmp_path):
    """The process count is torchrun's, in no .hydra/overrides.yaml: the refusal names it."""
    args = ["case=tiny", "ops=[linear_qkv]", f"hydra.run.dir={tmp_path}", *SMALL]
    assert run(args) == 0
    cmd = [*TORCHRUN, "-m", "autotuner.main", *args, "resume=true"]
    proc = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=WATCHDOG_S)
    refusals = [
        line for line in proc.stderr.splitlines() if line.startswith("autotuner: error: cannot resume")
    ]
    assert proc.returncode != 0 and refusals, proc.stderr[-3000:]
    assert (
        "world_size 1 -> 2" in refusals[0]
        and "resume with --nproc-per-node=1 and the settings" in refusals[0]
    )


@pytest.mark.torchrun
def test_a_refused_resume_leaves_no_lock_file_of_its_own(tp_run, tmp_path, capsys):
    """A single process resuming a TP=2 run's folder is refused; the lock file it made for itself
    (``.results.lock``, which the copied run lacks) goes with it: the folder is left as it was found."""
    for name in ("results.rank0.jsonl", "results.rank1.jsonl", "environment.json"):
        shutil.copy(tp_run / name, tmp_path / name)
    before = sorted(p.name for p in tmp_path.iterdir())
    assert run(["case=tiny", "ops=[linear_qkv]", f"hydra.run.dir={tmp_path}", *SMALL, "resume=true"]) == 2
    assert "cannot resume" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == before


@pytest.mark.torchrun
@pytest.mark.slow
def test_a_resume_one_ranks_file_refuses_is_refused_by_every_rank(tp_run, tmp_path):
    """A damaged line in rank 1's results: had only rank 1 read its file, rank 0 would wait for it in
    init_process_group until torchrun killed it; every rank reads every rank's file and refuses alike."""
    for name in ("results.rank0.jsonl", "results.rank1.jsonl", "environment.json"):
        shutil.copy(tp_run / name, tmp_path / name)
    rank1 = tmp_path / "results.rank1.jsonl"
    lines = rank1.read_text().splitlines()
    rank1.write_text("\n".join([lines[0], "{not json", *lines[1:]]) + "\n")
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir() if not p.name.startswith(".")}
    cmd = [*TORCHRUN, "-m", "autotuner.main", *TP_ARGS, f"hydra.run.dir={tmp_path}", *SMALL, "resume=true"]
    proc = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=WATCHDOG_S)
    assert proc.returncode != 0
    refusals = [
        line for line in proc.stderr.splitlines() if line.startswith("autotuner: error: cannot resume")
    ]
    assert refusals and all("results.rank1.jsonl" in line for line in refusals), proc.stderr[-3000:]
    # rank 0 refused too, or was ending when torchrun saw rank 1 end first and SIGTERMed it (a race):
    # either way not held in the process group's set-up until torchrun's SIGKILL, 30 s later (-9), as it
    # was when only rank 1 read rank 1's file
    assert "exitcode  : -9" not in proc.stderr, proc.stderr[-3000:]
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir() if not p.name.startswith(".")} == before


@pytest.mark.torchrun
@pytest.mark.slow
def test_resume_with_ranks_cut_at_different_rows(tp_run, tmp_path):
    """Rank 1 lost its last rows (killed a row after rank 0): a resumed job measures them on both ranks
    together instead of leaving the ranks in different ops."""
    # environment.json: the record a resume checks its configuration against
    for name in ("results.rank0.jsonl", "results.rank1.jsonl", "environment.json"):
        shutil.copy(tp_run / name, tmp_path / name)
    rank1 = tmp_path / "results.rank1.jsonl"
    rank1.write_text("\n".join(rank1.read_text().splitlines()[:3]) + "\n")  # the last row is lost
    before = load_rows(tmp_path / "results.rank0.jsonl")
    cmd = [*TORCHRUN, "-m", "autotuner.main", *TP_ARGS, f"hydra.run.dir={tmp_path}", *SMALL, "resume=true"]
    proc = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    after0 = load_rows(tmp_path / "results.rank0.jsonl")
    assert len(load_rows(rank1)) == 4 and len(after0) == 4
    kept = {(r["op"], r["phase"]): r["median_us"] for r in after0}
    for row in before[:3]:  # measured on both ranks: kept, not measured again
        assert kept[(row["op"], row["phase"])] == row["median_us"]


def _children(pid: int) -> list[int]:
    """The pids whose parent is ``pid`` (from /proc: each stat's field after the name)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
        except (OSError, IndexError, ValueError):
            continue
    return found


@pytest.mark.torchrun
@pytest.mark.slow
def test_ranks_whose_torchrun_is_killed_outright_stop_and_the_run_resumes(tmp_path):
    """torchrun killed with -9 passes no signal on, and its ranks, orphaned, ran the plan to its end.
    They stop within seconds (the parent-death signal); what they wrote is whole, and resume=true, run as
    the line they print says, finishes the run."""
    ops = ["ops=[linear_qkv,linear_proj,mlp]", "shapes.seq_len=[16,32]"]  # 12 rows a rank
    args = [*TP_ARGS[:2], *ops, *SMALL[1:], f"hydra.run.dir={tmp_path}"]
    cmd = [*TORCHRUN, "-m", "autotuner.main", *args]
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    first = tmp_path / "results.rank0.jsonl"
    try:
        deadline = time.monotonic() + WATCHDOG_S
        while proc.poll() is None and not (first.is_file() and first.read_text().count("\n")):
            assert time.monotonic() < deadline, "no row within the watchdog"
            time.sleep(0.01)
        ranks = _children(proc.pid)
        assert proc.poll() is None and len(ranks) == 2, "the job ended before its torchrun could be killed"
        os.kill(proc.pid, signal.SIGKILL)
        killed = time.monotonic()
        _, err = proc.communicate(timeout=60)  # the ranks hold its pipes until they end
        while any(Path(f"/proc/{pid}").exists() for pid in ranks) and time.monotonic() - killed < 60:
            time.sleep(0.05)
        assert not any(Path(f"/proc/{pid}").exists() for pid in ranks), "orphaned ranks ran on"
        assert time.monotonic() - killed < 10
    finally:
        for pid in _children(proc.pid) if proc.poll() is None else []:
            os.kill(pid, signal.SIGKILL)
    hint = [line for line in err.splitlines() if "finish the run with: torchrun" in line]
    assert len(hint) == 1, err[-3000:]
    done = [load_rows(path) for path in sorted(tmp_path.glob("results.rank*.jsonl"))]  # whole files
    assert done and 1 <= len(done[0]) < 12  # stopped, not run to the end
    resume = [*TORCHRUN, "-m", "autotuner.main", *args, "resume=true"]
    again = subprocess.run(resume, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=WATCHDOG_S)
    assert again.returncode == 0, again.stderr[-3000:]
    rows = load_rows(tmp_path / "results.rank0.jsonl")
    both = min(len(d) for d in done) if len(done) == 2 else 0  # a row one rank lacks is measured again
    assert len(rows) == 12 and rows[:both] == done[0][:both]
    assert len([r for r in load_rows(tmp_path / "results.jsonl") if r["rank"] == "max"]) == 12


@pytest.mark.torchrun
@pytest.mark.slow
def test_an_emulated_tp2_rank_equals_rank_0_of_the_torchrun_job(tp_run, tmp_path):
    """The same command without torchrun emulates rank 0 of TP=2 in one process: its rows hold exactly
    the FLOPs, weights and saved activations of the real rank 0, op by op."""
    assert run([*TP_ARGS, f"hydra.run.dir={tmp_path}", *SMALL]) == 0
    emulated = {(r["op"], r["phase"]): r for r in load_rows(tmp_path / "results.jsonl")}
    real = [r for r in load_rows(tp_run / "results.jsonl") if r["rank"] == 0]
    assert len(real) == len(emulated) == 4
    for row in real:
        twin = emulated[(row["op"], row["phase"])]
        assert twin["rank"] == 0 and twin["emulated_layout"] == "tp=2 ep=1 etp=2 sp=false world=2"
        measured = ("flops", "weight_bytes", "activation_bytes")[: 3 if row["phase"] == "forward" else 2]
        for column in measured:  # activations: what a forward saves
            assert twin[column] == row[column] is not None, (row["op"], row["phase"], column)
        assert twin["activation_bytes"] == row["activation_bytes"]
