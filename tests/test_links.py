"""Calibrated links: the collectives' bus bandwidth in the calibration file (autotuner.calibrate
collectives=true under torchrun, autotuner.results.calibration) and the collective times the predictor
reads from it (autotuner.predict.links)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from autotuner.calibrate import COLLECTIVE_SIZES
from autotuner.calibrate import main as calibrate_main
from autotuner.errors import UserError
from autotuner.predict.links import ASSUMED_BUS_BANDWIDTH, LinkWarning, collective_seconds, describe_gaps
from autotuner.results.calibration import LINK_KEYS, load, merge_links

REPO = Path(__file__).resolve().parents[1]
CEILINGS = {"device_type": "cpu", "peak_flops": {"fp32": 1e11}, "memory_bandwidth": 1e10, "buffer_bytes": 1}
# all_reduce over 2 gloo ranks (bus factor 2(n-1)/n = 1): 4 GB/s at the plateau; 1 MiB took 300 us
# (of which 1 MiB / 4 GB/s = 262.144 us is the bandwidth term, so 37.856 us latency), 16 MiB 4.3 ms.
LINKS = {
    "all_reduce_bandwidth": {"gloo:2": 4e9},
    "collective_points": {"all_reduce": {"gloo:2": {"bytes": [2**20, 2**24], "seconds": [300e-6, 4.3e-3]}}},
}


def _write(path: Path, data: dict) -> Path:
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize(
    "nbytes, expected",
    [
        (2**26, 4.3e-3 + (2**26 - 2**24) / 4e9),  # above the largest size: its time, then the plateau
        (2**22, 300e-6 + (2**22 - 2**20) / (2**24 - 2**20) * (4.3e-3 - 300e-6)),  # between: interpolated
        (2**19, 37.856e-6 + 2**19 / 4e9),  # below the smallest: its latency + bytes at the plateau
        (2**10, 37.856e-6 + 2**10 / 4e9),
    ],
)
def test_a_calibrated_all_reduce_follows_the_measured_sizes(nbytes, expected):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # calibrated: nothing assumed, no warning
        seconds, source = collective_seconds({**CEILINGS, **LINKS}, "all_reduce", nbytes, 2)
    assert seconds == pytest.approx(expected)
    assert source.kind == "modelled" and "collective_points[all_reduce][gloo:2]" in source.detail


def test_a_smallest_size_faster_than_the_plateau_gets_its_own_time_back():
    """Calibrated sizes are noisy: where the smallest ran at a higher bus bandwidth than the largest (here
    1 MiB in 200 us, under the plateau's 262 us for those bytes) there is no latency left to add, and the
    sizes below it go at its own rate, so that it gets its measured time back."""
    faster = {
        "all_reduce_bandwidth": {"gloo:2": 4e9},
        "collective_points": {
            "all_reduce": {"gloo:2": {"bytes": [2**20, 2**24], "seconds": [200e-6, 4.3e-3]}}
        },
    }
    for nbytes, expected in ((2**20, 200e-6), (2**19, 100e-6)):
        seconds, _ = collective_seconds({**CEILINGS, **faster}, "all_reduce", nbytes, 2)
        assert seconds == pytest.approx(expected)


def test_a_calibrated_bandwidth_without_points_is_the_ring_formula():
    calibration = {**CEILINGS, "reduce_scatter_bandwidth": {"gloo:4": 2e9}}
    seconds, source = collective_seconds(calibration, "reduce_scatter", 2**24, 4)
    assert seconds == pytest.approx(3 / 4 * 2**24 / 2e9)
    assert "reduce_scatter_bandwidth[gloo:4]" in source.detail and "ASSUMED" not in source.detail


@pytest.mark.parametrize(
    "kind, factor",
    [("all_reduce", 2 * 7 / 8), ("all_gather", 7 / 8), ("reduce_scatter", 7 / 8), ("send_recv", 1.0)],
)
def test_a_missing_link_is_an_assumed_bandwidth_with_a_warning_never_zero(kind, factor):
    with pytest.warns(LinkWarning, match="ASSUMED"):
        seconds, source = collective_seconds(None, kind, 10**9, 8)
    assert seconds == pytest.approx(factor * 10**9 / ASSUMED_BUS_BANDWIDTH["nccl"]) and seconds > 0
    assert source.kind == "modelled" and "ASSUMED" in source.detail and "--nproc-per-node=8" in source.detail


def test_another_world_size_borrows_the_nearest_calibrated_one_and_says_so():
    calibration = {
        **CEILINGS,
        "device_type": "cuda",
        "all_gather_bandwidth": {"nccl:2": 1e11, "nccl:8": 3e11},
    }
    with pytest.warns(LinkWarning, match="nccl:8"):
        seconds, source = collective_seconds(calibration, "all_gather", 8e9, 4 * 4)
    assert seconds == pytest.approx(15 / 16 * 8e9 / 3e11)
    assert "borrowed" in source.detail and "nccl:16" in source.detail


def test_the_gaps_of_many_collectives_are_said_a_line_per_bandwidth_that_stood_in():
    """What tune shows under its table: the collectives and world sizes that each borrowed or assumed
    bandwidth timed, with the one command per size that would calibrate them."""
    calibration = {**CEILINGS, "device_type": "cuda", "all_gather_bandwidth": {"nccl:8": 3e11}}
    calibration["all_reduce_bandwidth"] = {"nccl:8": 2e11}
    with pytest.warns(LinkWarning) as caught:
        for kind in ("all_reduce", "all_gather", "reduce_scatter"):
            for world in (16, 32, 16):
                collective_seconds(calibration, kind, 2**20, world)
    assert len(caught) == 9  # one warning a call, each naming its own collective and size
    lines = describe_gaps(w.message.gap for w in caught)
    assert lines == [
        "reduce_scatter over 16, 32 ranks: ASSUMED bus bandwidth 100 GB/s, the calibration has no nccl entry "
        "for them; run torchrun --nproc-per-node=N -m autotuner.calibrate collectives=true for N = 16, 32",
        "all_gather, all_reduce over 16, 32 ranks: bus bandwidth borrowed from the calibration at nccl:8 "
        "(all_gather 300 GB/s, all_reduce 200 GB/s), none at these sizes; run torchrun --nproc-per-node=N "
        "-m autotuner.calibrate collectives=true for N = 16, 32",
    ]
    one = describe_gaps([caught[-1].message.gap])
    assert one == [
        "reduce_scatter over 16 ranks: ASSUMED bus bandwidth 100 GB/s, the calibration has no nccl entry for "
        "them; run torchrun --nproc-per-node=16 -m autotuner.calibrate collectives=true"
    ]


def test_one_rank_sends_nothing():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning either: nothing is assumed
        assert collective_seconds(None, "all_reduce", 2**20, 1)[0] == 0.0


def test_load_accepts_files_with_and_without_links_and_rejects_bad_ones(tmp_path):
    assert LINK_KEYS["all_reduce"] not in load(_write(tmp_path / "old.json", CEILINGS))
    merged = merge_links(CEILINGS, LINKS)
    assert load(_write(tmp_path / "new.json", merged))["all_reduce_bandwidth"] == {"gloo:2": 4e9}
    for bad in (
        {"all_reduce_bandwidth": {"gloo:2": 0}},
        {"all_gather_bandwidth": {"gloo": 1e9}},
        {"collective_points": {"all_reduce": {"gloo:2": {"bytes": [1], "seconds": []}}}},
    ):
        with pytest.raises(UserError, match="calibrate collectives=true") as info:
            load(_write(tmp_path / "bad.json", {**CEILINGS, **bad}))
        assert "\n" not in str(info.value)


def test_merge_keeps_the_ceilings_and_other_links():
    earlier = merge_links(CEILINGS, {"all_reduce_bandwidth": {"gloo:4": 1e9}})
    merged = merge_links(earlier, LINKS)
    assert merged["peak_flops"] == CEILINGS["peak_flops"] and merged["memory_bandwidth"] == 1e10
    assert merged["all_reduce_bandwidth"] == {"gloo:4": 1e9, "gloo:2": 4e9}


def test_collectives_outside_torchrun_is_one_line_and_exit_2(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    out = tmp_path / "cal.json"
    assert calibrate_main(["device=cpu", "collectives=true", f"out={out}"]) == 2
    err = capsys.readouterr().err.strip()
    assert "torchrun --nproc-per-node=N" in err and len(err.splitlines()) == 1 and not out.exists()


@pytest.mark.torchrun
def test_torchrun_measures_the_collectives_and_merges_them_into_the_file(tmp_path):
    out = _write(tmp_path / "cal.json", {**CEILINGS, "all_reduce_bandwidth": {"gloo:4": 1.5e9}})
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    proc = subprocess.run(
        [
            *command,
            "-m",
            "autotuner.calibrate",
            "device=cpu",
            "collectives=true",
            "budget_s=0.2",
            f"out={out}",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = load(out)
    assert data["peak_flops"] == CEILINGS["peak_flops"] and data["memory_bandwidth"] == 1e10  # kept
    assert data["all_reduce_bandwidth"]["gloo:4"] == 1.5e9  # another world's entry kept
    for kind in ("all_reduce", "all_gather", "reduce_scatter", "send_recv"):
        bandwidth = data[LINK_KEYS[kind]]["gloo:2"]
        points = data["collective_points"][kind]["gloo:2"]
        assert len(points["bytes"]) == len(COLLECTIVE_SIZES["cpu"]) and points["bytes"] == sorted(
            points["bytes"]
        )
        # the file's bandwidth is the largest size's bus bandwidth: 2(n-1)/n or (n-1)/n bytes per second
        factor = 0.5 if kind in ("all_gather", "reduce_scatter") else 1.0  # send_recv: the whole buffer
        assert bandwidth == pytest.approx(factor * points["bytes"][-1] / points["seconds"][-1])
        # and the predictor gives each measured size back at its measured time
        for nbytes, measured in zip(points["bytes"], points["seconds"], strict=True):
            seconds, source = collective_seconds(data, kind, nbytes, 2)
            assert seconds == pytest.approx(measured) and "calibration" in source.detail
    assert any(line.split()[:2] == ["all_reduce", "gloo:2"] for line in proc.stdout.splitlines())
    # CPU processes share the memory: Adam timed with both at it, per parameter on each rank
    assert 0 < data["adam_seconds_per_parameter_together"]["gloo:2"] < 1e-6
