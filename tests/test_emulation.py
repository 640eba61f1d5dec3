"""One rank of a TP/EP layout in one process (autotuner.model.emulation): its shards and token counts are
the real rank's, its collectives recorded, its rank chosen or the busiest."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from autotuner.main import run
from autotuner.model.routing import Routing
from autotuner.ops_test.moe_ops import forced_map
from autotuner.results import load_rows

REPO = Path(__file__).resolve().parents[1]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
SEQ, BATCH = 16, 1
SMALL = [f"shapes.seq_len=[{SEQ}]", f"shapes.micro_batch_size=[{BATCH}]", "progress=false", "report=false"]
EXACT = ("flops", "weight_bytes", "activation_bytes")
# What these tests assert (shards, counts, collectives) does not depend on the sampling: a short budget
QUICK = ["timing.budget_s=0.2", "timing.min_time_s=0"]


def _rows(tmp_path: Path, name: str, *args: str) -> dict[tuple[str, str], dict]:
    """The rows of an in-process run (no torchrun), by (op, phase); the run must succeed."""
    run_dir = tmp_path / name
    assert run([*args, f"hydra.run.dir={run_dir}", *SMALL, *QUICK]) == 0
    rows = load_rows(run_dir / "results.jsonl")
    assert all(r["status"] == "ok" for r in rows), [r["error"] for r in rows]
    return {(r["op"], r["phase"]): r for r in rows}


@pytest.mark.slow
def test_an_emulated_tp4_linear_fc1_holds_a_quarter_of_the_tp1_weights(tmp_path):
    model = ["case=tiny", "hf.num_key_value_heads=4", "ops=[linear_fc1]"]  # 4 KV groups for TP=4
    one = _rows(tmp_path, "tp1", *model)
    four = _rows(tmp_path, "tp4", *model, "tf.tensor_model_parallel_size=4")
    for phase in ("forward", "backward"):
        sharded, whole = four[("linear_fc1", phase)], one[("linear_fc1", phase)]
        assert sharded["weight_bytes"] * 4 == whole["weight_bytes"]
        assert sharded["flops"] * 4 == whole["flops"]
        assert (sharded["rank"], sharded["tensor_parallel"]) == (0, 4)
        assert sharded["emulated_layout"] == "tp=4 ep=1 etp=4 sp=false world=4"
        assert whole["emulated_layout"] is None and whole["collectives"] is None
    env = json.loads((tmp_path / "tp4" / "environment.json").read_text())
    assert env["emulated_rank"] == {
        "rank": 0,
        "world": 4,
        "tp": 4,
        "ep": 1,
        "etp": 4,
        "sequence_parallel": False,
    }
    assert env["world_size"] == 1


@pytest.mark.slow
def test_an_emulated_rank_records_the_collectives_megatron_issues(tmp_path):
    """TP=2: the row-parallel linear all-reduces its output forward, the column-parallel one its input's
    gradient backward; with sequence parallelism they become an all-gather before the column-parallel
    linear and a reduce-scatter after the row-parallel one. Each of the full [s, b, h] buffer, over tp."""
    hidden = 64  # case tiny's hidden_size
    full = SEQ * BATCH * hidden * 4  # fp32
    ops = "ops=[linear_qkv,linear_proj]"
    plain = _rows(tmp_path, "tp2", "case=tiny", ops, "tf.tensor_model_parallel_size=2")
    assert plain[("linear_qkv", "forward")]["collectives"] == []
    assert plain[("linear_qkv", "backward")]["collectives"] == [
        {"kind": "all_reduce", "bytes": full, "group": "tp"}
    ]
    assert plain[("linear_proj", "forward")]["collectives"] == [
        {"kind": "all_reduce", "bytes": full, "group": "tp"}
    ]
    sp = _rows(
        tmp_path, "sp", "case=tiny", ops, "tf.tensor_model_parallel_size=2", "tf.sequence_parallel=true"
    )
    assert sp[("linear_qkv", "forward")]["collectives"] == [
        {"kind": "all_gather", "bytes": full, "group": "tp"}
    ]
    assert sp[("linear_proj", "forward")]["collectives"] == [
        {"kind": "reduce_scatter", "bytes": full, "group": "tp"}
    ]
    # the fit check estimated every phase, the backwards through the emulated collectives on meta too
    assert all(row["estimated_peak_bytes"] for row in sp.values()), sp
    # results.csv holds the list as JSON, which the rows reader takes back
    csv_text = (tmp_path / "sp" / "results.csv").read_text()
    assert '""kind"": ""reduce_scatter""' in csv_text


def _expected_tokens(rank: int, routing: Routing, seed: int = 1234) -> list[int]:
    """The tokens each of ``rank``'s 4 experts gets at EP=2 (tiny_moe: 8 experts, top-2): the forced map
    the MoE ops draw, from each of the 2 ranks of the group (they hold the same tokens at TP=1)."""
    routing_map = forced_map(routing, seed, SEQ * BATCH, 8, 2, __import__("torch").device("cpu"))
    local = routing_map[:, rank * 4 : (rank + 1) * 4]
    return [2 * int(n) for n in local.sum(dim=0)]


@pytest.mark.slow
def test_an_emulated_expert_rank_holds_its_experts_and_the_tokens_its_routing_sends(tmp_path):
    ops = "ops=[experts,token_dispatch]"
    zipf = Routing("zipf")
    one = _rows(tmp_path, "ep1", "case=tiny_moe", ops, "moe.routing=zipf")
    args = ["case=tiny_moe", ops, "moe.routing=zipf", "tf.expert_model_parallel_size=2"]
    second = _rows(tmp_path, "rank1", *args, "parallel.rank=1")
    busiest = _rows(tmp_path, "default", *args)
    for rows, rank in ((second, 1), (busiest, 0)):  # zipf: expert 0 is the hottest, so rank 0 the busiest
        experts = rows[("experts", "forward")]
        assert experts["rank"] == rank
        assert experts["weight_bytes"] * 2 == one[("experts", "forward")]["weight_bytes"]
        assert experts["tokens_per_expert"] == _expected_tokens(rank, zipf)
        dispatch = rows[("token_dispatch", "forward")]["collectives"]
        assert {c["kind"] for c in dispatch} == {"all_gather"} and {c["group"] for c in dispatch} == {"ep"}
    assert sum(_expected_tokens(0, zipf)) > sum(_expected_tokens(1, zipf))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["tf.tensor_model_parallel_size=2", "parallel.rank=2"], "parallel.rank=2 is not a rank of the"),
        (["tf.tensor_model_parallel_size=2", "parallel.rank=-1"], "give 0 <= rank < 2"),
        (["parallel.rank=0"], "parallel.rank=0 picks the rank of an emulated layout"),
    ],
)
def test_a_rank_outside_the_emulated_layout_is_one_line_and_exit_2(overrides, message, capsys, tmp_path):
    assert run(["case=tiny", f"hydra.run.dir={tmp_path}", "ops=[linear_fc1]", *overrides]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}


@pytest.mark.torchrun
@pytest.mark.slow
def test_an_emulated_expert_rank_equals_that_rank_of_a_real_torchrun_job(tmp_path):
    """EP=2 with the default (learned) routing: each emulated rank's rows equal that rank's rows of a
    torchrun job, token counts included (at TP=1 the ranks hold the same tokens)."""
    ops = "ops=[router,token_dispatch,experts,token_combine]"
    args = ["case=tiny_moe", ops, "tf.expert_model_parallel_size=2"]
    real_dir = tmp_path / "real"
    cmd = [*TORCHRUN, "-m", "autotuner.main", *args, f"hydra.run.dir={real_dir}", *SMALL]
    proc = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    real = load_rows(real_dir / "results.jsonl")
    for rank in (0, 1):
        emulated = _rows(tmp_path, f"rank{rank}", *args, f"parallel.rank={rank}")
        mine = [r for r in real if r["rank"] == rank]
        assert len(mine) == len(emulated) == 8
        for row in mine:
            twin = emulated[(row["op"], row["phase"])]
            for column in (*EXACT, "tokens_per_expert"):
                assert twin[column] == row[column], (row["op"], row["phase"], column, rank)


def test_the_collectives_column_reads_back_from_either_file_and_refuses_anything_else():
    from autotuner.results import RowsFileError, _csv_value, check_row

    listed = [{"kind": "all_reduce", "bytes": 4096, "group": "tp"}]
    row = {"op": "linear_proj", "phase": "forward", "point": "s16_b1"}
    assert check_row({**row, "collectives": listed}, "here")["collectives"] == listed
    assert check_row({**row, "collectives": _csv_value(listed)}, "here")["collectives"] == listed
    assert check_row({**row, "collectives": "[]"}, "here")["collectives"] == []
    for bad in ([{"kind": "all_reduce", "bytes": -1, "group": "tp"}], "4096", [4096], "[{"):
        with pytest.raises(RowsFileError, match="column 'collectives'"):
            check_row({**row, "collectives": bad}, "here")


def test_a_dry_run_of_an_emulated_layout_previews_the_ranks_shards(capsys):
    def fc1_parameters(*overrides: str) -> int:
        assert run(["case=tiny", "ops=[linear_fc1]", "dry_run=true", *SMALL[:2], *overrides]) == 0
        line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("linear_fc1"))
        return int(line.split()[3])

    assert fc1_parameters("tf.tensor_model_parallel_size=2") * 2 == fc1_parameters()


def test_a_dry_run_of_a_sequence_parallel_rank_costs_every_phase(capsys):
    """Its collectives' buffers are made where their input is: on meta in the preview, not the run's
    device (a backward then met a CPU tensor and could not be costed)."""
    sp = ["tf.tensor_model_parallel_size=2", "tf.sequence_parallel=true"]
    assert (
        run(["case=tiny", "ops=[transformer_layer,linear_qkv,linear_fc2]", "dry_run=true", *SMALL[:2], *sp])
        == 0
    )
    table = capsys.readouterr().out
    assert "backward" in table and "n/a" not in table, table
