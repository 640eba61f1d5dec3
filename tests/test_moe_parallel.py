"""Expert parallelism under real torchrun processes (gloo on CPU): EP=2 with TP=1 and TP=2 on tiny_moe
(8 experts, top-2, every layer MoE), so each rank holds 4 experts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from autotuner.config import compose_config
from autotuner.main import run
from autotuner.results import load_rows
from autotuner.runner.spec import open_session, resolve_spec

REPO = Path(__file__).resolve().parents[1]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
SEQ, BATCH, TOPK, LOCAL_EXPERTS = 16, 1, 2, 4
SMALL = [f"shapes.seq_len=[{SEQ}]", f"shapes.micro_batch_size=[{BATCH}]", "progress=false", "report=false"]
MOE_OPS = ["moe_layer", "router", "token_dispatch", "experts", "token_combine"]
# Every rank's routing covers the tokens of the whole expert-parallel group: the tokens of one rank,
# gathered from the ranks of the EP x ETP group (the whole job here) by the all-gather dispatcher.
EP_ARGS = {
    1: ["tf.expert_model_parallel_size=2"],
    2: ["tf.expert_model_parallel_size=2", "tf.tensor_model_parallel_size=2", "tf.sequence_parallel=true"],
}
WATCHDOG_S = 300  # a deadlock ends here, not at CI's limit


def _env() -> dict[str, str]:
    # pytest may run inside a torchrun-like environment; the children must start clean
    return {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}


def _torchrun(args: list[str]) -> None:
    proc = subprocess.run(
        [*TORCHRUN, *args], cwd=REPO, env=_env(), capture_output=True, text=True, timeout=WATCHDOG_S
    )
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.torchrun
@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
def test_expert_parallel_rows_per_rank_with_the_default_timing(tp, tmp_path):
    """get_data with EP=2 (default timing: a rank leaving the sampling loop early would deadlock the
    others in the dispatcher's collectives): every rank's rows ok, sampled alike, saying EP=2, each
    rank's expert rows holding its own 4 experts, which together got every gathered token's top-2."""
    ops = f"ops=[transformer_layer,{','.join(MOE_OPS)}]"
    _torchrun(
        ["-m", "autotuner.main", "case=tiny_moe", *EP_ARGS[tp], ops, f"hydra.run.dir={tmp_path}", *SMALL]
    )
    rows = load_rows(tmp_path / "results.jsonl")
    ops_run = ["transformer_layer", *MOE_OPS]
    assert {(r["op"], r["phase"], r["rank"]) for r in rows} == {
        (op, phase, rank) for op in ops_run for phase in ("forward", "backward") for rank in (0, 1, "max")
    }
    assert all(r["status"] == "ok" and r["tensor_parallel"] == tp for r in rows), [
        (r["op"], r.get("error")) for r in rows if r["status"] != "ok"
    ]
    per_rank = [r for r in rows if r["rank"] != "max"]
    by_key: dict[tuple, list[dict]] = {}
    for row in per_rank:
        by_key.setdefault((row["op"], row["phase"], row["point"]), []).append(row)
    for key, pair in by_key.items():
        decided = {(r["samples"], r["calls_per_sample"], r["stop_reason"]) for r in pair}
        assert len(decided) == 1, (key, decided)  # the ranks called the op equally often
    for row in per_rank:
        if row["op"] not in MOE_OPS:
            continue
        assert (row["expert_parallel"], row["token_dispatcher"]) == (2, "allgather"), row["op"]
        assert len(row["tokens_per_expert"]) == LOCAL_EXPERTS, row["op"]
    # the all-gather happened: the two ranks' experts together got the top-2 of both ranks' tokens
    # (each rank holds SEQ / TP of the sequence under sequence parallelism)
    gathered = SEQ // tp * BATCH * 2
    for op in MOE_OPS:
        histograms = {r["rank"]: r["tokens_per_expert"] for r in per_rank if r["op"] == op}
        assert sum(map(sum, histograms.values())) == gathered * TOPK, (op, histograms)
        top = next(r for r in rows if r["op"] == op and r["phase"] == "forward" and r["rank"] == "max")
        ranks = [r for r in per_rank if r["op"] == op and r["phase"] == "forward"]
        assert top["median_us"] == max(r["median_us"] for r in ranks)
        # the merged row's memory is the fullest rank's, whichever rank was the slowest
        for memory in ("activation_bytes", "peak_bytes"):
            assert top[memory] == max(r[memory] for r in ranks), (op, memory)


@pytest.mark.torchrun
@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
def test_expert_parallel_layer_equals_the_single_rank_layer(tp, tmp_path):
    """The EP=2 MoE layer's forward, each rank on its own tokens, equals an EP=1 layer holding the same
    router and experts (gathered from both ranks) on all the tokens."""
    saved = tmp_path / "ep2.pt"
    _torchrun([str(REPO / "tests" / "ep_reference.py"), str(saved), str(tp)])
    ep2 = torch.load(saved)
    spec = resolve_spec(compose_config(["case=tiny_moe", "device=cpu", "ops=[moe_layer]"]))
    _, ctx = open_session(spec)
    mlp = ctx.layer.mlp
    assert len(mlp.experts.local_experts) == 2 * LOCAL_EXPERTS
    with torch.no_grad():
        mlp.router.weight.copy_(ep2["router"])
        for index, expert in enumerate(mlp.experts.local_experts):
            for name, param in expert.named_parameters():
                param.copy_(ep2["experts"][f"{index}.{name}"])
        expected, _ = mlp(ep2["inputs"])
    atol = 1e-5
    # the experts' output, far above the tolerance (not zeros, which would match anything)
    assert expected.abs().max() > 50 * atol and expected.abs().mean() > atol
    torch.testing.assert_close(ep2["outputs"], expected, rtol=1e-4, atol=atol)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["case=tiny_moe", "tf.expert_model_parallel_size=3"], "does not divide the 8 experts"),
        (["case=tiny_moe", "tf.expert_model_parallel_size=0"], "at least 1"),
        (["case=tiny", "tf.expert_model_parallel_size=2"], "has no experts"),
        (["case=tiny_moe", "tf.tensor_model_parallel_size=2"], "add tf.sequence_parallel=true"),
    ],
)
def test_expert_parallel_settings_this_job_cannot_run_are_refused_up_front(
    overrides, message, capsys, tmp_path
):
    assert run([f"hydra.run.dir={tmp_path}", *overrides]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
