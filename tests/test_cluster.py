"""The cluster model: cluster files and presets, where a layout's groups lie (against Megatron-Core's own
rank generator), the collectives' formulas, a cluster's links measured by calibrate links=true over real
processes, and predictions priced over a cluster."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from autotuner.errors import UserError
from autotuner.predict.cluster import bus_factor, fit, load, presets
from autotuner.predict.collectives import Group, collective_time, megatron_groups, span
from autotuner.predict.layout import Layout
from autotuner.predict.prediction import load_calibration_for, load_runs, predict

REPO = Path(__file__).resolve().parents[1]
H200 = REPO / "tests" / "fixtures" / "h200_llama7b" / "profile"


def test_presets_hold_every_figure_with_its_source_and_say_they_are_published_rates():
    assert {"dgx_h100", "dgx_h200", "dgx_a100"} <= set(presets())
    h100 = load("dgx_h100")
    assert h100.gpus_per_node == 8 and h100.nominal
    assert h100.intra.bandwidth == 450e9  # NVLink 4: 900 GB/s both ways
    assert h100.inter.bandwidth == 8 * 50e9 / 8  # 8 x 400 Gb/s a node, a GPU's share
    for text in (h100.intra.bandwidth_source, h100.intra.latency_source, h100.inter.bandwidth_source):
        assert "docs.nvidia.com" in text or "tuning.cc" in text
    assert "tuning.cc" in h100.base_latency_source
    assert "published rates" in h100.describe()


def test_a_cluster_file_that_does_not_fit_the_schema_is_one_line_naming_the_field(tmp_path):
    data = json.loads((REPO / "autotuner/predict/clusters/dgx_h100.json").read_text())
    data["intra_node"]["bandwidth"] = "fast"
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(data))
    with pytest.raises(UserError, match=r"intra_node\.bandwidth must be a number"):
        load(bad)
    with pytest.raises(UserError, match="cannot read the cluster file"):
        load(tmp_path / "absent.json")
    (tmp_path / "dgx_h100").write_text("{}")
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        with pytest.raises(UserError, match="names both the preset"):
            load("dgx_h100")
    finally:
        os.chdir(cwd)


@pytest.mark.parametrize(("tp", "cp", "dp", "pp"), [(2, 2, 2, 2), (8, 1, 6, 1), (4, 2, 3, 2), (1, 1, 48, 1)])
def test_the_groups_are_megatrons_own(tp, cp, dp, pp):
    """The ranks of each group holding rank 0, as Megatron-Core's RankGenerator numbers them (the default
    order tp-cp-ep-dp-pp; the data-parallel group with context parallelism is its dp-cp group)."""
    from megatron.core.parallel_state import RankGenerator

    megatron = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order="tp-cp-ep-dp-pp")
    ours = megatron_groups(tp, cp, dp, pp)
    for token, name in (("tp", "tp"), ("cp", "cp"), ("dp-cp", "dp"), ("pp", "pp")):
        group = ours[name]
        assert megatron.get_ranks(token)[0] == [k * group.stride for k in range(group.size)], token


def test_where_a_group_lies():
    assert span(Group("tp", 8, 1), 8) == (8, 1)
    assert span(Group("dp", 48, 1), 8) == (8, 6)
    assert span(Group("dp", 6, 8), 8) == (1, 6)  # tp=8: each data-parallel rank on its own node
    assert span(Group("dp", 8, 2), 8) == (4, 2)  # tp=2: four of the group a node
    assert span(Group("dp", 4, 3), 8) == (3, 2)  # a stride that does not divide the node: the fullest


def test_the_hierarchical_formulas_with_the_presets_figures():
    """docs/cluster_model.md's formulas: inside a node the NVLink ring alone; across nodes the slower of
    the two levels, pipelined, and each level's ring steps of latency."""
    h100 = load("dgx_h100")
    w_i, w_e, a_i, a_e, base = 450e9, 50e9, 3.4e-6, 14e-6, 8.4e-6
    nbytes = 1e9
    inside, _ = collective_time(h100, "all_reduce", nbytes, Group("tp", 8, 1))
    assert inside == pytest.approx(2 * 7 / 8 * nbytes / w_i + base + 14 * a_i)
    across, formula = collective_time(h100, "all_reduce", nbytes, Group("dp", 48, 1))
    network = 2 * 5 / 6 * nbytes / 8 / w_e
    assert network > 2 * 7 / 8 * nbytes / w_i  # the network is the slower level here
    assert across == pytest.approx(network + base + 14 * a_i + 10 * a_e)
    assert "8 a node over 6 nodes" in formula
    gather, _ = collective_time(h100, "all_gather", nbytes, Group("dp", 6, 8))  # one a node: NICs only
    assert gather == pytest.approx(5 / 6 * nbytes / w_e + base + 5 * a_e)
    a2a, _ = collective_time(h100, "all_to_all", nbytes, Group("ep", 16, 1))
    assert a2a == pytest.approx(8 / 16 * nbytes / w_e + base + a_i + a_e)
    pair, _ = collective_time(h100, "send_recv", nbytes, Group("pp", 2, 8))
    assert pair == pytest.approx(nbytes / w_e + base + a_e)
    assert collective_time(h100, "all_reduce", nbytes, Group("dp", 1))[0] == 0


def test_the_fit_of_a_collectives_times():
    """Latency + bus factor x bytes / bus bandwidth, each size weighing alike; the error said."""
    sizes = [1e4, 1e6, 1e8]
    seconds = [20e-6 + bus_factor("all_reduce", 4) * b / 1e11 for b in sizes]
    fitted = fit("all_reduce", 4, sizes, seconds)
    assert fitted["bus_bandwidth"] == pytest.approx(1e11) and fitted["latency"] == pytest.approx(20e-6)
    assert fitted["worst_error"] == pytest.approx(0, abs=1e-9)
    with pytest.raises(ValueError, match="do not grow"):
        fit("all_reduce", 4, sizes, [1e-3, 1e-3, 1e-3])


def test_predictions_price_the_data_parallel_reduction_by_where_its_ranks_lie():
    """The same 16 data-parallel ranks of the H200 profile's model: inside two nodes the all-reduce's
    network half decides; without a cluster the calibration's assumed link; and a layout larger than a
    cluster file's nodes is refused."""
    runs = load_runs([H200])
    cal = load_calibration_for(runs, None)
    layout = Layout(seq_len=2048, dp=16, global_batch_size=64)
    dgx = predict(runs, layout, cal, cluster=load("dgx_h200"))
    assert "8 a node over 2 nodes" in dgx.step.dp_source.detail
    assert "dgx_h200" in dgx.cluster and any("published rates" in note for note in dgx.notes)
    params = dgx.memory[0].params.value
    expected, _ = collective_time(load("dgx_h200"), "all_reduce", params * 4, Group("dp", 16, 1))
    assert dgx.step.dp_reduction == pytest.approx(expected)
    plain = predict(runs, layout, cal)
    assert plain.step.dp_reduction != pytest.approx(dgx.step.dp_reduction)
    assert plain.cluster is None and "dp_grad_reduce" not in json.dumps(plain.to_json()["step"])


def _links(tmp_path: Path, *extra: str) -> dict:
    out = tmp_path / "cluster.json"
    launch = "-m torch.distributed.run --standalone --nproc-per-node=2 -m autotuner.calibrate links=true"
    command = [sys.executable, *launch.split(), f"out={out}", "budget_s=0.1", *extra]
    done = subprocess.run(command, capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"written to {out}" in done.stdout
    return json.loads(out.read_text())


@pytest.mark.slow
@pytest.mark.torchrun
def test_calibrate_links_measures_the_links_and_the_cluster_prices_them_as_measured(tmp_path):
    """Two gloo processes on one host: a node of two ranks, each collective's fit written and read back;
    the cluster then prices each collective at each measured size within the fit's own stated error."""
    data = _links(tmp_path)
    assert data["nodes"] == 1 and data["gpus_per_node"] == 2 and "inter_node" not in data
    cluster = load(tmp_path / "cluster.json")
    assert not cluster.nominal and "measured" in cluster.describe()
    assert set(data["measured"]["intra_node"]) >= {"all_reduce", "all_to_all", "send_recv"}
    for kind, fitted in data["measured"]["intra_node"].items():
        assert fitted["ranks"] == 2
        for nbytes, seconds in zip(fitted["bytes"], fitted["seconds"], strict=True):
            priced, _ = collective_time(cluster, kind, nbytes, Group("tp", 2, 1))
            assert abs(priced / seconds - 1) <= fitted["worst_error"] + 1e-9, kind
    with pytest.raises(UserError, match="no inter_node link"):
        collective_time(cluster, "all_reduce", 1e6, Group("dp", 4, 1))


@pytest.mark.slow
@pytest.mark.torchrun
def test_calibrate_links_between_nodes_takes_the_level_it_cannot_measure_from_a_preset(tmp_path):
    """One rank a node (two "nodes" of one process): the link between them measured, the node's own from
    the preset; without the preset, refused in one line."""
    data = _links(tmp_path, "ranks_per_node=1", "cluster=dgx_h100")
    assert data["nodes"] == 2 and set(data["measured"]) == {"inter_node"}
    assert "preset dgx_h100" in data["intra_node"]["bandwidth_source"]
    cluster = load(tmp_path / "cluster.json")
    fitted = data["measured"]["inter_node"]["all_reduce"]
    priced, _ = collective_time(cluster, "all_reduce", fitted["bytes"][-1], Group("dp", 2, 1))
    assert abs(priced / fitted["seconds"][-1] - 1) <= fitted["worst_error"] + 1e-9
    refused = subprocess.run(
        [sys.executable, "-m", "autotuner.calibrate", "links=true"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert refused.returncode == 2 and "torchrun" in refused.stderr and len(refused.stderr.splitlines()) == 1
