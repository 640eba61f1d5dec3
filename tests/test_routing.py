"""Routing control for the MoE ops (autotuner.model.routing), the expert columns of the rows, and the
report's time-per-expert figure.

The maps are checked for what each mode promises (topk distinct experts per token; balanced counts
within one; zipf shares following the weights of a draw without replacement), the probs against
Megatron's own top-k routing, and the columns end to end: a test-only op's ``OpCall.row_fields`` in the
rows of the real get_data and torch_profiler launchers run in-process, in the nsys launcher's rows built
from such a worker record, in results.csv, and back through load_rows. Bad ``moe.*`` values are one line
and exit 2 from the real CLI.
"""

from __future__ import annotations

import csv
import itertools
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from autotuner.errors import UserError
from autotuner.launchers.nsys_process import NsysRun
from autotuner.launchers.nsys_report import NvtxRange
from autotuner.launchers.nsys_rows import Outcome, ReportData, build_rows, read_worker
from autotuner.main import run
from autotuner.model.routing import (
    ROUTINGS,
    ExpertLoad,
    Routing,
    experts_impl,
    forced_probs,
    forced_routing_map,
    moe_setup_fields,
    zipf_weights,
)
from autotuner.ops.naming import format_range, parse_range
from autotuner.ops_test.base import FUNCTIONAL, REGISTRY, OpCall, OpContext, ShapePoint, register_op
from autotuner.report.data import Run
from autotuner.report.experts import expert_points, experts_figure
from autotuner.report.figures import make_figures
from autotuner.report.page import render_page
from autotuner.results import CALL_COLUMNS, ResultsWriter, RowsFileError, check_row, load_rows

FORCED = [m for m in ROUTINGS if m != "learned"]
FAST = [
    "shapes.seq_len=[16]",
    "shapes.micro_batch_size=[2]",
    "progress=false",
    "report=false",
]


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# --- the maps --------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", FORCED)
@pytest.mark.parametrize("tokens, experts, topk", [(37, 8, 3), (5, 4, 4), (64, 6, 1), (0, 4, 2)])
def test_every_forced_mode_gives_topk_distinct_experts_per_token(mode, tokens, experts, topk):
    routing_map = forced_routing_map(tokens, experts, topk, Routing(mode), _gen())
    assert routing_map.dtype == torch.bool and routing_map.shape == (tokens, experts)
    # a boolean map cannot count an expert twice: topk True per row is topk distinct experts
    assert routing_map.sum(dim=1).tolist() == [topk] * tokens


@pytest.mark.parametrize("tokens, experts, topk", [(37, 8, 3), (10, 4, 2), (7, 128, 8), (1000, 60, 6)])
def test_balanced_counts_differ_by_at_most_one(tokens, experts, topk):
    counts = forced_routing_map(tokens, experts, topk, Routing("balanced"), None).sum(dim=0)
    assert counts.sum() == tokens * topk and counts.max() - counts.min() <= 1
    again = forced_routing_map(tokens, experts, topk, Routing("balanced"), _gen(5))
    assert torch.equal(again.sum(dim=0), counts)  # deterministic: no draw


def test_zipf_with_top1_follows_the_weights():
    tokens, experts = 40_000, 8
    counts = forced_routing_map(tokens, experts, 1, Routing("zipf", 1.2), _gen()).sum(dim=0)
    assert all(a > b for a, b in itertools.pairwise(counts.tolist())), counts
    weights = zipf_weights(experts, 1.2)
    assert weights[0] / weights[1] == pytest.approx(2**1.2)
    # a share's standard deviation is at most 0.0025 here: 0.012 is about five of them
    assert torch.allclose(counts.double() / tokens, weights, atol=0.012), (counts / tokens, weights)


def _inclusion_without_replacement(weights: list[float]) -> list[float]:
    """P(expert i among a token's 2 experts) when drawing 2 without replacement: first i, or j then i."""
    total = sum(weights)
    out = []
    for i, w in enumerate(weights):
        first = w / total
        second = sum(v / total * w / (total - v) for j, v in enumerate(weights) if j != i)
        out.append(first + second)
    return out


def test_zipf_with_top2_is_a_draw_without_replacement():
    tokens, experts, s = 40_000, 4, 1.5
    counts = forced_routing_map(tokens, experts, 2, Routing("zipf", s), _gen(3)).sum(dim=0)
    assert all(a > b for a, b in itertools.pairwise(counts.tolist())), counts
    expected = _inclusion_without_replacement(zipf_weights(experts, s).tolist())
    assert sum(expected) == pytest.approx(2)
    shares = (counts.double() / tokens).tolist()
    assert shares == pytest.approx(expected, abs=0.012)
    # flatter than the weights: the hot expert saturates at one assignment per token
    assert shares[0] / shares[-1] < (experts**s)


def test_a_large_zipf_exponent_still_gives_topk_experts():
    routing_map = forced_routing_map(50, 16, 4, Routing("zipf", 200.0), _gen())
    assert routing_map.sum(dim=1).eq(4).all()
    assert routing_map[:, :4].all()  # the weights fall so steeply that the first four always win


def test_uniform_spreads_evenly_on_a_large_draw():
    tokens, experts, topk = 20_000, 8, 2
    counts = forced_routing_map(tokens, experts, topk, Routing("uniform"), _gen()).sum(dim=0)
    assert (counts.double() / (tokens * topk)).sub(1 / experts).abs().max() < 0.01


@pytest.mark.parametrize("mode", ["uniform", "zipf"])
def test_the_same_seed_gives_the_same_map(mode):
    first = forced_routing_map(300, 8, 2, Routing(mode), _gen(7))
    assert torch.equal(first, forced_routing_map(300, 8, 2, Routing(mode), _gen(7)))
    assert not torch.equal(first, forced_routing_map(300, 8, 2, Routing(mode), _gen(8)))


def test_learned_is_not_forced_and_bad_sizes_are_refused():
    assert not Routing().forced and Routing("zipf").forced
    with pytest.raises(ValueError, match="not forced"):
        forced_routing_map(4, 4, 1, Routing(), _gen())
    with pytest.raises(ValueError, match="1 <= topk <= experts"):
        forced_routing_map(4, 4, 5, Routing("uniform"), _gen())
    with pytest.raises(ValueError, match="seeded torch.Generator"):
        forced_routing_map(4, 4, 1, Routing("uniform"), None)


@pytest.mark.parametrize("mode, zipf_s, words", [("x", 1.2, "moe.routing='x'"), ("zipf", 0, "moe.zipf_s=0")])
def test_bad_values_are_one_line_naming_the_fix(mode, zipf_s, words):
    with pytest.raises(UserError) as raised:
        Routing(mode, zipf_s)
    message = str(raised.value)
    assert "\n" not in message and words in message and ": set moe." in message


def test_forced_probs_are_what_megatrons_topk_router_returns_for_that_map():
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

    routing_map = forced_routing_map(12, 8, 4, Routing("uniform"), _gen())
    probs = forced_probs(routing_map, torch.bfloat16)
    # logits equal on the chosen experts and lower elsewhere: top-k then softmax gives 1/k on each
    logits = routing_map.to(torch.bfloat16) * 5
    megatron_probs, megatron_map = topk_routing_with_score_function(logits, 4)
    assert torch.equal(megatron_map, routing_map)
    assert probs.dtype == megatron_probs.dtype == torch.bfloat16 and probs.shape == megatron_probs.shape
    assert torch.equal(probs, megatron_probs)
    assert probs.float().sum(dim=1).sub(1).abs().max() < 1e-2


# --- the load and its columns ------------------------------------------------------------------------


def test_expert_load_is_max_over_mean():
    routing_map = torch.zeros(6, 4, dtype=torch.bool)
    routing_map[:, 0] = True  # 6 tokens
    routing_map[:3, 1] = True  # 3
    routing_map[0, 2] = True  # 1, expert 3: 0
    load = ExpertLoad.from_map(routing_map)
    assert load.tokens_per_expert == (6, 3, 1, 0)
    assert (load.min, load.max, load.mean) == (0, 6, 2.5) and load.imbalance == 6 / 2.5
    assert ExpertLoad.from_map(routing_map, range(1, 3)).tokens_per_expert == (3, 1)  # an EP rank's share
    assert ExpertLoad.from_counts(torch.tensor([4, 4])).imbalance == 1.0
    assert ExpertLoad.from_counts([0, 0]).imbalance is None  # nothing routed here: nothing to compare
    fields = load.row_fields("zipf")
    assert fields == {
        "routing": "zipf",
        "tokens_per_expert": [6, 3, 1, 0],
        "tokens_per_expert_min": 0,
        "tokens_per_expert_max": 6,
        "expert_imbalance": 2.4,
    }
    assert set(fields) <= set(CALL_COLUMNS)


def test_setup_fields_name_megatrons_class_past_our_instrumented_subclass():
    from autotuner.ops.instrument import instrument_module

    class SequentialMLP(torch.nn.Module):
        pass

    experts = instrument_module(SequentialMLP(), "experts")
    assert type(experts).__name__ == "InstrumentedSequentialMLP" and experts_impl(experts) == "SequentialMLP"
    config = type("Config", (), {"moe_token_dispatcher_type": "allgather", "expert_model_parallel_size": 2})
    fields = moe_setup_fields(experts, config)
    assert fields == {"experts_impl": "SequentialMLP", "token_dispatcher": "allgather", "expert_parallel": 2}
    assert set(fields) <= set(CALL_COLUMNS)


def test_the_histogram_is_a_list_in_jsonl_joined_in_csv_and_read_back_from_both(tmp_path: Path):
    row = {"case": "tiny", "op": "experts", "phase": "forward", "point": "s8_b1", "rank": 0}
    writer = ResultsWriter(tmp_path)
    writer.write({**row, **ExpertLoad((3, 5, 0)).row_fields("uniform")})
    assert load_rows(tmp_path / "results.jsonl")[0]["tokens_per_expert"] == [3, 5, 0]
    with open(tmp_path / "results.csv", newline="") as handle:
        assert next(csv.DictReader(handle))["tokens_per_expert"] == "3;5;0"
    assert check_row({**row, "tokens_per_expert": "3;5;0"}, "x")["tokens_per_expert"] == [3, 5, 0]
    assert check_row({**row, "tokens_per_expert": ""}, "x")["tokens_per_expert"] is None
    assert "tokens_per_expert" not in check_row(row, "x")  # a file from before the column loads
    for bad in ("3;x", [1.5, 2], {"a": 1}, 7):
        with pytest.raises(RowsFileError, match="expected a list of whole numbers"):
            check_row({**row, "tokens_per_expert": bad}, "FILE line 1")


# --- the columns through the launchers -----------------------------------------------------------------

EXPERTS, TOPK = 4, 2


@pytest.fixture
def routed_op() -> Iterator[str]:
    """A test-only op that states its call's routing, as an MoE op does (a functional op: no MoE model is
    built for it, though the run's case must have experts for moe.* to be accepted)."""

    @register_op("routed_linear", needs=FUNCTIONAL)
    def routed_linear(ctx: OpContext, point: ShapePoint) -> OpCall:
        """A linear whose call states a forced routing's expert load."""
        from autotuner.ops.instrument import instrument_module  # its ranges, for the profiler launchers

        tokens = point.seq_len * point.micro_batch_size
        linear = instrument_module(torch.nn.Linear(8, 8).to(ctx.device), "routed_linear")
        routing_map = forced_routing_map(tokens, EXPERTS, TOPK, ctx.routing, ctx.generator("routing"))
        fields = ExpertLoad.from_map(routing_map).row_fields(ctx.routing.mode)
        fields.update(experts_impl="SequentialMLP", token_dispatcher="allgather", expert_parallel=1)
        return OpCall(linear, (ctx.randn((tokens, 8), "x"),), linear, row_fields=fields)

    @register_op("stray_fields", needs=FUNCTIONAL)
    def stray_fields(ctx: OpContext, point: ShapePoint) -> OpCall:
        """An op whose row_fields name a column no op may state."""
        linear = torch.nn.Linear(8, 8)
        return OpCall(linear, (ctx.randn((4, 8), "x"),), linear, row_fields={"median_us": 1.0})

    try:
        yield "routed_linear"
    finally:
        del REGISTRY["routed_linear"], REGISTRY["stray_fields"]


def _expected_counts() -> list[int]:
    """The op's histogram at s16_b2 with moe.routing=zipf moe.zipf_s=1.1 and the default seed."""
    context = OpContext(None, torch.device("cpu"), torch.float32, 1234)
    gen = context.generator("routing")
    return forced_routing_map(32, EXPERTS, TOPK, Routing("zipf", 1.1), gen).sum(dim=0).tolist()


def _check_routed_rows(rows: list[dict], counts: list[int]) -> None:
    routed = [r for r in rows if r["op"] == "routed_linear"]
    assert {r["phase"] for r in routed} == {"forward", "backward"} and all(
        r["status"] == "ok" for r in routed
    )
    for row in routed:
        assert row["routing"] == "zipf" and row["tokens_per_expert"] == counts
        assert (row["tokens_per_expert_min"], row["tokens_per_expert_max"]) == (min(counts), max(counts))
        assert row["expert_imbalance"] == pytest.approx(max(counts) / (sum(counts) / EXPERTS))
        assert (row["experts_impl"], row["token_dispatcher"], row["expert_parallel"]) == (
            "SequentialMLP",
            "allgather",
            1,
        )


@pytest.mark.parametrize(
    "launcher",
    [
        ["launcher=get_data", "timing.warmup=1", "timing.min_samples=2", "timing.max_samples=3"],
        [
            "launcher=torch_profiler",
            "launcher.warmup=1",
            "launcher.active=2",
            "launcher.with_stack=false",
            "launcher.record_shapes=false",
            "launcher.profile_memory=false",
        ],
    ],
    ids=["get_data", "torch_profiler"],
)
@pytest.mark.slow
def test_row_fields_reach_both_phases_rows_and_the_run_record(routed_op, tmp_path: Path, launcher):
    # an MoE case (routing settings are refused on a dense one), its model not built for functional ops
    args = ["case=tiny_moe", f"ops=[{routed_op},stray_fields]", f"hydra.run.dir={tmp_path}", *FAST, *launcher]
    assert run([*args, "moe.routing=zipf", "moe.zipf_s=1.1"]) == 1  # stray_fields fails, the plan goes on
    rows = load_rows(tmp_path / "results.jsonl")
    counts = _expected_counts()
    assert sum(counts) == 32 * TOPK
    _check_routed_rows(rows, counts)
    stray = [r for r in rows if r["op"] == "stray_fields"]
    assert stray and all(r["status"] == "failed" and "median_us" in r["error"] for r in stray)
    assert all("CALL_COLUMNS" in r["error"] for r in stray)
    with open(tmp_path / "results.csv", newline="") as handle:
        csv_rows = [r for r in csv.DictReader(handle) if r["op"] == "routed_linear"]
    assert {r["tokens_per_expert"] for r in csv_rows} == {";".join(map(str, counts))}
    record = json.loads((tmp_path / "environment.json").read_text())
    assert record["routing"] == {"mode": "zipf", "zipf_s": 1.1}
    assert record["fingerprint"]["moe.routing"] == "zipf"  # a resume with another routing is refused


@pytest.mark.slow
def test_nsys_rows_keep_the_columns_the_worker_recorded(routed_op, tmp_path: Path):
    """The nsys launcher's rows are the report's times plus the worker's record (its Runner's rows): a
    worker record written by the real Runner, and a report holding one range per iteration."""
    args = ["case=tiny_moe", f"ops=[{routed_op}]", f"hydra.run.dir={tmp_path}", *FAST]
    assert (
        run([*args, "timing.min_samples=2", "timing.max_samples=2", "moe.routing=zipf", "moe.zipf_s=1.1"])
        == 0
    )
    worker_rows, in_flight = read_worker(tmp_path)
    point = ShapePoint(16, 2)
    measured = {}
    for index, phase in enumerate(("forward", "backward")):
        names = [format_range("routed_linear", phase, point.label, i) for i in range(3)]
        measured[("routed_linear", phase, point.label)] = [
            NvtxRange(name, 1000 * index + 10 * i, 1000 * index + 10 * i + 5, 1, parse_range(name))
            for i, name in enumerate(names)
        ]
    outcome = Outcome(NsysRun(0, ""), worker_rows, in_flight, ReportData(measured=measured))
    spec = type(
        "Spec",
        (),
        {
            "case": "tiny",
            "dtype": "fp32",
            "device": torch.device("cpu"),
            "tf_config": type("TF", (), {"tensor_model_parallel_size": 1}),
            "call_counts": {},
            "rank": 0,
            "row_rank": 0,
            "emulation": None,
        },
    )
    op = REGISTRY["routed_linear"]
    rows = build_rows(spec, [(point, op, "forward"), (point, op, "backward")], outcome)
    assert all(r["launcher"] == "nsys" and r["samples"] == 3 for r in rows)
    _check_routed_rows(rows, _expected_counts())


@pytest.mark.parametrize(
    "override, words",
    [
        ("moe.routing=skewed", "moe.routing='skewed' is not one of learned, uniform, balanced, zipf"),
        ("moe.zipf_s=-1", "moe.zipf_s=-1.0 must be a finite number above 0"),
        ("moe.zipf_s=steep", "moe.zipf_s"),  # not a float: Hydra's own check, as one line
    ],
)
def test_bad_moe_values_are_one_line_exit_2_and_nothing_written(tmp_path: Path, capsys, override, words):
    run_dir = tmp_path / "run"
    assert run(["case=tiny", f"hydra.run.dir={run_dir}", override, *FAST]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and words in lines[0], lines
    assert not (run_dir / "results.jsonl").exists() and not (run_dir / "environment.json").exists()


@pytest.mark.parametrize("override", ["moe.routing=zipf", "moe.zipf_s=2"])
def test_routing_settings_on_a_model_without_experts_are_refused(tmp_path: Path, capsys, override):
    """A dense case with moe.routing=zipf was accepted, and its record said zipf, which nothing read."""
    run_dir = tmp_path / "run"
    assert run(["case=tiny", f"hydra.run.dir={run_dir}", override, *FAST]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"autotuner: error: {override}"), lines
    assert "case tiny has no experts" in lines[0] and "drop them" in lines[0]
    assert not run_dir.exists()


def test_the_refusal_of_a_top1_router_names_the_override_that_fixes_it(capsys):
    """Megatron refuses top-1 routing without pre-softmax in its training script's words
    ("--moe-router-pre-softmax"): the line names the override a user of this tool types, which then works."""
    assert run(["case=tiny_moe", "hf.num_experts_per_tok=1", "dry_run=true"]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and "use tf.moe_router_pre_softmax=true when topk is 1" in lines[0], lines
    assert "--moe" not in lines[0]
    assert (
        run(["case=tiny_moe", "hf.num_experts_per_tok=1", "tf.moe_router_pre_softmax=true", "dry_run=true"])
        == 0
    )


# --- the report figure --------------------------------------------------------------------------------


def _row(op: str, phase: str, point: str, median_us: float, counts: list[int] | None, routing: str) -> dict:
    row = {"case": "moe", "op": op, "phase": phase, "point": point, "status": "ok", "median_us": median_us}
    seq_len, mbs = (int(p) for p in point[1:].split("_b"))
    row.update(seq_len=seq_len, micro_batch_size=mbs, rank=0, launcher="get_data", dtype="fp32")
    return {**row, **(ExpertLoad(tuple(counts)).row_fields(routing) if counts is not None else {})}


def test_experts_figure_draws_time_per_expert_against_tokens_per_expert(tmp_path: Path):
    rows = [
        _row("experts", "forward", "s16_b1", 400.0, [8, 8, 8, 8], "balanced"),
        _row("experts", "backward", "s16_b1", 800.0, [8, 8, 8, 8], "balanced"),
        _row("experts", "forward", "s64_b1", 2000.0, [80, 30, 10, 8], "zipf"),
        _row("experts", "forward", "s32_b1", 900.0, None, "learned"),  # no histogram: not drawn
        _row("linear_fc1", "forward", "s16_b1", 50.0, None, "learned"),
    ]
    the_run = Run(tmp_path, "moe", rows)
    points = {(p.phase, p.point): p for p in expert_points(the_run)}
    assert set(points) == {("forward", "s16_b1"), ("backward", "s16_b1"), ("forward", "s64_b1")}
    zipf = points[("forward", "s64_b1")]
    assert (zipf.routing, zipf.local_experts, zipf.mean_tokens, zipf.max_tokens) == ("zipf", 4, 32.0, 80)
    assert zipf.time_per_expert_us == 500.0

    figure = experts_figure([the_run], {})
    forward_ax, backward_ax = figure.axes
    segments = [line for line in forward_ax.get_lines() if len(line.get_xdata()) == 2]
    drawn = sorted([*s.get_xdata(), *s.get_ydata()] for s in segments)
    # x: mean then max tokens per local expert; y: median time / local experts, in seconds
    assert drawn[0] == pytest.approx([8, 8, 100e-6, 100e-6])
    assert drawn[1] == pytest.approx([32, 80, 500e-6, 500e-6]) and len(drawn) == 2
    back = [line for line in backward_ax.get_lines() if len(line.get_xdata()) == 2]
    assert len(back) == 1 and list(back[0].get_ydata()) == pytest.approx([200e-6, 200e-6])

    files = {f.name: f for f in make_figures([the_run], tmp_path)}
    assert files["experts"].path == tmp_path / "experts.png" and files["experts"].path.stat().st_size > 0
    assert "divided by its number of local experts" in files["experts"].caption
    page = render_page([the_run], list(files.values()))
    assert 'id="experts"' in page and "expert imbalance" in page  # the figure, and the table's column


def test_no_experts_rows_no_experts_figure(tmp_path: Path):
    (tmp_path / "experts.png").write_bytes(b"stale")
    dense = Run(tmp_path, "dense", [_row("linear_fc1", "forward", "s16_b1", 50.0, None, "learned")])
    files = make_figures([dense], tmp_path)
    assert "experts" not in {f.name for f in files} and not (tmp_path / "experts.png").exists()
    assert 'id="experts"' not in render_page([dense], files)
    # experts rows that all failed: the figure is listed, saying why it is not drawn
    failed = Run(
        tmp_path, "moe", [{**_row("experts", "forward", "s16_b1", 1.0, [1, 1], "zipf"), "status": "failed"}]
    )
    listed = {f.name: f for f in make_figures([failed], tmp_path)}
    assert listed["experts"].path is None and "No ok experts row" in listed["experts"].caption
