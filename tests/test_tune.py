"""``python -m autotuner.tune`` (layouts ranked by predicted step time, memory-filtered) and
``python -m autotuner.validate`` (the prediction against the real steps)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from autotuner.main import run
from autotuner.predict.__main__ import main as predict_main
from autotuner.predict.prediction import load_calibration_for, load_runs, predict
from autotuner.tune import main as tune_main
from autotuner.tune import parse_settings, rank
from autotuner.validate.__main__ import main as validate_main
from tests.conftest import FAST

SETTINGS = ["gpus=4", "global_batch_size=16", "seq_len=32", "dtype=fp32"]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> Path:
    """case=tiny profiled at s32 with micro-batches 1 and 2 (what the ranking's shown layouts use)."""
    run_dir = tmp_path_factory.mktemp("tiny") / "run"
    # the ops a stage's time is made of (the layer whole, the model's ends, core attention for selective
    # recompute): what the predictor reads first, so the ranking rests on measured rows
    ops = "ops=[embedding,transformer_layer,core_attention,final_layernorm,output_layer]"
    argv = ["case=tiny", ops, "shapes.seq_len=[32]", "shapes.micro_batch_size=[1,2]", *FAST]
    assert run([*argv, "report=false", f"hydra.run.dir={run_dir}"]) == 0
    return run_dir


@pytest.mark.slow
def test_layouts_are_ranked_by_predicted_step_time_among_those_that_fit(tiny_run: Path):
    dirs, settings = parse_settings([str(tiny_run), *SETTINGS, "gpu_memory_gb=1"])
    ranked, _ = rank(dirs, settings)
    fitting = [r for r in ranked if r.fits]
    assert fitting and all(r.fits for r in ranked[: len(fitting)])  # the ones that fit come first
    times = [r.prediction.step_seconds for r in fitting]
    assert times == sorted(times) and all(t > 0 for t in times)
    # each layout's schedule is kept as its end alone (the boxes of thousands of layouts took gigabytes),
    # and that end is what the whole schedule's is
    first = fitting[0].prediction
    assert all(r.prediction.step.schedule.boxes == () for r in ranked)
    whole = predict(load_runs([tiny_run]), first.layout, load_calibration_for(load_runs([tiny_run]), None))
    assert whole.step.schedule.boxes and whole.step.schedule.end == first.step.schedule.end
    assert whole.step_seconds == first.step_seconds
    # a memory limit between the smallest and the largest need drops exactly the layouts above it
    needs = sorted(r.memory_bytes for r in ranked)
    limit_gb = (needs[0] + needs[-1]) / 2 / 1e9
    dirs, settings = parse_settings([str(tiny_run), *SETTINGS, f"gpu_memory_gb={limit_gb}", "margin=0"])
    ranked, _ = rank(dirs, settings)
    assert {r.prediction.layout for r in ranked if r.fits} == {
        r.prediction.layout for r in ranked if r.memory_bytes <= limit_gb * 1e9
    }
    assert 0 < sum(r.fits for r in ranked) < len(ranked)


def test_gpus_per_node_keeps_tensor_parallelism_inside_a_node(capsys):
    """Megatron-Core accepts a tensor-parallel group across nodes; gpus_per_node keeps tp at most that, and
    a bad value is one line."""
    dims = ["case=tiny", *SETTINGS, "gpu_memory_gb=1", "calibration=h100"]
    everywhere, _ = rank([], parse_settings(dims)[1])
    assert {r.prediction.layout.tp for r in everywhere} == {1, 2}  # tiny's 2 query groups allow tp=2
    in_node, _ = rank([], parse_settings([*dims, "gpus_per_node=1"])[1])
    assert {r.prediction.layout.tp for r in in_node} == {1}
    assert {r.prediction.layout for r in in_node} == {
        r.prediction.layout for r in everywhere if r.prediction.layout.tp == 1
    }
    assert tune_main([*dims, "gpus_per_node=0"]) == 2
    err = capsys.readouterr().err.strip()
    assert "gpus_per_node=0 must be a positive integer" in err and len(err.splitlines()) == 1


@pytest.mark.slow
def test_the_command_prints_the_top_the_explanation_and_the_plan(tiny_run: Path, capsys):
    assert tune_main([str(tiny_run), *SETTINGS, "gpu_memory_gb=1", "top=3", "explain=1"]) == 0
    out = capsys.readouterr().out
    assert "layouts predicted" in out and "deciding op" in out
    assert "stage" in out and "sources" in out  # the explained prediction
    assert "measurements behind this ranking:" in out


@pytest.mark.slow
def test_nothing_fits_is_one_line_and_exit_2(tiny_run: Path, capsys):
    assert tune_main([str(tiny_run), *SETTINGS, "gpu_memory_gb=0.000001"]) == 2
    err = capsys.readouterr().err.strip()
    assert "no layout fits" in err and len(err.splitlines()) == 1


def test_without_runs_a_calibration_is_needed_and_a_preset_prices_every_op(capsys):
    """With nothing measured of the GPU, neither rows nor a calibration, there is no prediction: one line
    naming the presets and the command that calibrates one. With a preset every op is modelled from its
    figures, and the ranking says which preset, where and when it was measured."""
    assert tune_main(["case=tiny", *SETTINGS, "gpu_memory_gb=1", "top=2"]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert captured.out == "" and len(err.splitlines()) == 1
    assert "no profile and no calibration of the GPU" in err
    assert (
        "calibration=h100 or calibration=h200" in err and "python -m autotuner.calibrate device=cuda" in err
    )
    assert tune_main(["case=tiny", *SETTINGS, "gpu_memory_gb=1", "top=2", "calibration=h200"]) == 0
    out = capsys.readouterr().out
    # nothing measured: the ops modelled, the optimizer and the gradients' accumulation scaled from the
    # preset's timed rates
    ranked = [line for line in out.splitlines() if line.split()[:1] in (["1"], ["2"])]
    assert len(ranked) == 2 and all("modelled" in line and "measured" not in line for line in ranked)
    (said,) = [line for line in out.splitlines() if line.startswith("calibration: ")]
    assert said.startswith("calibration: preset h200: NVIDIA H200") and "measured 2026-12-04" in said
    assert "peak_flops[fp32]" in said  # the figure the modelled layers took
    assert "rows (#1): none: every op's time is modelled from the calibration" in out
    # what the modelled times rest on is said under the table, not only with explain=, each once
    warnings = [line for line in out.splitlines() if line.startswith("warning: ")]
    assert not any("assumed a peak" in line or "ASSUMED peak" in line for line in warnings)
    assert len(warnings) == len(set(warnings))
    # the links: the shown layouts' collectives, timed from the one assumed bandwidth, said in one line
    # (three before, one per collective and world size)
    links = [line for line in warnings if "bus bandwidth" in line]
    assert len(links) == 1 and "ASSUMED bus bandwidth 100 GB/s" in links[0], links
    assert " over 2 ranks: " in links[0] and "autotuner.calibrate collectives=true" in links[0]
    # the runs that would measure the top layouts, cold-cached for the visits that follow a backward
    assert "-m autotuner.main case=tiny launcher=get_data timing.flush_cache=true" in out


def test_the_plan_measures_both_cache_kinds_where_the_layouts_want_both(tmp_path: Path, capsys):
    """A calibration whose caches hold tiny's ops: each stage's first forward (after a backward) wants a
    flushed row, the rest warm ones, so every missing point is planned as a run of each kind."""
    cal = tmp_path / "cal.json"
    sizes = {"warm_cache_bytes": 2**30, "shared_cache_bytes": 2**31}
    cal.write_text(json.dumps({"peak_flops": {"fp32": 1e12}, "memory_bandwidth": 1e10, **sizes}))
    assert tune_main(["case=tiny", *SETTINGS, "gpu_memory_gb=1", "top=2", f"calibration={cal}"]) == 0
    out = capsys.readouterr().out
    plan = out[out.index("measurements behind this ranking:") :].splitlines()
    flushed = [line.replace("timing.flush_cache=true", "") for line in plan if "flush_cache=true" in line]
    # the warm runs time each forward after the op's backward, as the steps run them
    warm_way = "timing.flush_cache=false timing.forward_after_backward=true"
    warm = [line.replace(warm_way, "") for line in plan if "flush_cache=false" in line]
    assert flushed and sorted(flushed) == sorted(warm)  # the same runs, once each way
    count = int(plan[0].split("measurements behind this ranking: ")[1].split()[0])
    assert count == len(flushed)  # a point measured both ways is one needed point


@pytest.mark.parametrize(
    "args",
    [["gpus=4", "seq_len=32"], ["case=tiny", *SETTINGS, "gpu_memory_gb=-1"], ["case=tiny", *SETTINGS, "x=1"]],
)
def test_bad_settings_are_one_line_and_exit_2(args, capsys):
    assert tune_main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("autotuner-tune: error:") and len(err.splitlines()) == 1


@pytest.mark.slow
def test_the_adam_steps_own_memory_is_the_validated_peak_where_it_is_the_larger(
    tiny_run: Path, tmp_path: Path
):
    """With the distributed optimizer at dp=1 Adam updates the whole flat buffer as one tensor; on the CPU
    its step holds two fp32 temporaries of it, more than the tiny model's forward-backward holds, so that
    step sets the peak of the real steps: predicted without it, the peak read 4% low."""
    out = tmp_path / "prediction.json"
    argv = [str(tiny_run), "seq_len=32", "micro_batch_size=1", "global_batch_size=2", "dtype=fp32"]
    assert validate_main([*argv, "distributed_optimizer=true", "repeats=1", f"json={out}"]) == 0
    record = json.loads(out.read_text())
    (memory,) = record["memory"]
    forward_backward = sum(memory[term]["value"] for term in ("activations", "logits", "in_flight"))
    assert memory["optimizer_step"]["value"] > forward_backward
    assert abs(record["validation"]["memory_error"]) < 0.01


@pytest.mark.slow
def test_validate_runs_the_real_steps_and_records_the_errors(tiny_run: Path, tmp_path: Path, capsys):
    out = tmp_path / "prediction.json"
    argv = [str(tiny_run), "seq_len=32", "micro_batch_size=1", "global_batch_size=2", "dtype=fp32"]
    # at another depth than the run's 2 layers (its rows are per layer): the steps build that model
    assert validate_main([*argv, "repeats=2", "num_layers=3", f"json={out}"]) == 0
    printed = capsys.readouterr().out
    assert "predicted vs measured steps" in printed
    record = json.loads(out.read_text())["validation"]
    # where a step's error comes from: each phase predicted beside its measured median
    phases = record["phases"]
    assert list(phases) == ["forward-backward", "gradient reduction", "optimizer"]
    assert phases["forward-backward"]["measured_s"] > phases["optimizer"]["measured_s"] > 0
    assert phases["gradient reduction"] == {"predicted_s": 0.0, "measured_s": pytest.approx(0.0, abs=1e-3)}
    assert all(f"    {name} " in printed for name in phases)
    assert record["measured_step_s"] > 0 and record["measured_peak_bytes"] > 0
    # the measured steps themselves are kept beside the prediction
    kept = json.loads((tmp_path / "prediction.steps.json").read_text())
    assert kept["ranks"] and kept["step_s"] > 0 and not (tmp_path / "prediction.steps.stderr.txt").exists()
    assert record["step_error"] == pytest.approx(record["predicted_step_s"] / record["measured_step_s"] - 1)
    assert record["memory_error"] == pytest.approx(
        record["predicted_peak_bytes"] / record["measured_peak_bytes"] - 1
    )
    # one process, no collectives: the memory of the real steps is deterministic, and the prediction from
    # the rows (a backward's peak net of the saved activations it frees) meets it; the in-flight term's
    # old lower bound (every backward credited with freeing all it saved first) read -2.5% here
    assert abs(record["memory_error"]) < 0.01
    # beside it, Megatron-LM's own report of the first stage against that stage's measured peak (one
    # process: the step's peak); its bf16 assumptions read fp32 steps low
    assert record["measured_first_stage_peak_bytes"] == record["measured_peak_bytes"]
    assert 0 < record["megatron_report_bytes"] < record["measured_peak_bytes"]
    assert "Megatron-LM's report of stage 0" in printed
    assert "autotuner.validate.steps" in " ".join(record["command"])
    assert "hf.num_hidden_layers=3" in record["command"]
    # where inside the forward-backward: each hooked op's predicted time per visit beside its time in the
    # steps, the layers' backward with their share of the gradients' accumulation
    inside = {item["what"]: item for item in record["in_step"]}
    assert {"transformer_layer forward", "transformer_layer backward", "output_layer forward"} <= set(inside)
    assert {"forward per micro-batch", "backward per micro-batch"} <= set(inside)
    assert all(
        item["stage"] == 0 and item["predicted_s"] > 0 and item["measured_s"] > 0 for item in inside.values()
    )
    assert inside["transformer_layer backward"]["how"] == "its row + its gradients' accumulation"
    assert "    inside the steps, per visit" in printed and "stage 0 transformer_layer backward" in printed
    # and the median step op by op: the one process's visits, and the time between them
    (rank,) = record["timeline"]
    assert rank["rank"] == 0 and 0 <= rank["between_ops_s"] < rank["forward_backward_s"]
    assert (
        sum(1 for key, *_ in rank["visits"] if key == "transformer_layer.forward") == 3 * 2
    )  # 3 layers, m=2
    assert "rank 0 (stage 0, tp 0, dp 0)" in printed and "+ between" in printed


def test_expert_parallel_layouts_are_ranked_with_their_experts_split(capsys):
    assert tune_main(["case=tiny_moe", *SETTINGS, "gpu_memory_gb=1", "top=40", "calibration=h100"]) == 0
    out = capsys.readouterr().out
    ranked = [line for line in out.splitlines() if line.strip()[:1].isdigit() and " ep=" in line]
    with_ep = [line for line in ranked if " ep=1 " not in line]
    assert with_ep and "not ranked" not in out
    # and what their profiling runs would be: the MoE ops measured at that expert-parallel size
    assert "tf.expert_model_parallel_size=" in out


@pytest.mark.slow
def test_a_prediction_at_another_depth_and_the_deepest_that_fits(tiny_run: Path, tmp_path: Path, capsys):
    from autotuner.predict.inputs import ModelShape
    from autotuner.predict.layout import Layout
    from autotuner.predict.prediction import deepest_that_fits, load_runs, predict

    runs = load_runs([tiny_run])
    layout = Layout(seq_len=32, global_batch_size=2, dtype="fp32")
    model = ModelShape.from_environment(runs.env)
    assert model.num_layers == 2  # tiny's own depth, which caps num_layers=fit
    one, two = (predict(runs, layout, model=model.at_depth(n)) for n in (1, 2))
    need = [max(m.total for m in p.memory) for p in (one, two)]
    assert need[0] < need[1] and one.step_seconds < two.step_seconds
    for limit_bytes, depth in ((need[1] * 2, 2), ((need[0] + need[1]) / 2, 1)):
        gb = limit_bytes / 0.9 / 1e9  # less the 10% margin
        assert deepest_that_fits(runs, layout, model, gb).num_layers == depth
    argv = [str(tiny_run), "seq_len=32", "global_batch_size=2", "dtype=fp32", "report=false"]
    out = tmp_path / "deeper.json"
    assert predict_main([*argv, "num_layers=3", f"json={out}"]) == 0
    deeper = json.loads(out.read_text())
    assert deeper["model"]["num_layers"] == 3
    gb = need[0] * 0.5 / 1e9
    assert predict_main([*argv, "num_layers=fit", f"gpu_memory_gb={gb}", f"json={out}"]) == 2
    assert "not even 1 layer of tiny fit" in capsys.readouterr().err
    # an uneven split: the depths it can split; none up to the case's own is one line saying why
    uneven = Layout(seq_len=32, pp=2, global_batch_size=2, dtype="fp32", last_stage_layers=1)
    assert deepest_that_fits(runs, uneven, model, need[1] * 4 / 0.9 / 1e9).num_layers == 2
    split = ["pp=2", "first_stage_layers=2", "num_layers=fit", "gpu_memory_gb=80"]
    assert predict_main([*argv, *split, f"json={out}"]) == 2
    err = capsys.readouterr().err.strip()
    assert "first_stage_layers=2 leaves 0 of the 2 layers to the 1 other pipeline rank" in err
    assert len(err.splitlines()) == 1


@pytest.mark.slow
@pytest.mark.parametrize("depth", ["num_layers=0", "num_layers=deep", "num_layers=fit"])
def test_a_bad_depth_is_one_line_and_exit_2(tiny_run: Path, depth: str, capsys):
    assert predict_main([str(tiny_run), "seq_len=32", "report=false", depth]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("autotuner-predict: error: num_layers=") and len(err.splitlines()) == 1


@pytest.mark.slow
def test_outputs_that_cannot_be_written_are_refused_before_the_work(tiny_run: Path, tmp_path: Path, capsys):
    """Each is one line, exit 2, and nothing printed or written first: found at the end, after the work
    (the prediction, the plan), the error would lose it."""
    blocker = tmp_path / "a-file"
    blocker.write_text("keep\n")
    argv = [str(tiny_run), "seq_len=32", "global_batch_size=2", "dtype=fp32", "report=false"]
    refused = [
        (
            tune_main,
            ["case=tiny", *SETTINGS, "gpu_memory_gb=1", f"slurm={blocker}"],
            "is a file, not a folder",
        ),
        (tune_main, ["case=tiny", *SETTINGS, "gpu_memory_gb=nan"], "is not a finite number"),
        (tune_main, ["case=tiny", *SETTINGS, "gpu_memory_gb=1", "top=3", "explain=4"], "and top=3"),
        (tune_main, ["case=tiny", *SETTINGS, "gpu_memory_gb=1", "explain=0"], "explain=0: give"),
        (predict_main, [*argv, f"slurm={blocker / 'plan'}"], "is a file, not a folder"),
        (predict_main, [*argv, f"json={tmp_path}"], "is a folder: give a file name"),
        (validate_main, [*argv, "repeats=0"], "repeats=0 must be at least 1"),
        # os.access says yes to root for any folder: the check makes a file there, as the writer will
        (predict_main, [*argv, "json=/proc/prediction.json"], "cannot write in /proc"),
    ]
    for main, args, words in refused:
        assert main(args) == 2, args
        captured = capsys.readouterr()
        assert captured.out == "" and len(captured.err.strip().splitlines()) == 1, captured.err
        assert words in captured.err
    assert blocker.read_text() == "keep\n" and not (tiny_run / "prediction.json").exists()
    # the folders a json= or slurm= path names are made
    out = tmp_path / "new" / "deeper" / "prediction.json"
    assert predict_main([*argv, f"json={out}"]) == 0 and json.loads(out.read_text())["layout"]


@pytest.mark.slow
def test_a_validation_whose_steps_fail_keeps_the_prediction_and_says_so_in_one_line(
    tiny_run: Path, tmp_path: Path, capsys, monkeypatch
):
    """The steps' processes are real; their command is one that fails as a worker's bad input does."""
    import sys

    from autotuner.validate import steps

    real_group = steps.run_process_group
    failing = [sys.executable, "-c", "import sys; sys.exit('autotuner: error: the steps refused this')"]
    monkeypatch.setattr(
        steps, "run_process_group", lambda command, env, timeout_s: real_group(failing, env, 60)
    )
    out = tmp_path / "prediction.json"
    argv = [str(tiny_run), "seq_len=32", "global_batch_size=2", "dtype=fp32", "report=false"]
    assert validate_main([*argv, f"json={out}"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "measured steps failed (1): autotuner: error: the steps refused this" in err[0]
    assert f"the prediction, unvalidated, is in {out}" in err[0]
    # the workers' whole output is kept beside it, and the line says where
    log = tmp_path / "prediction.steps.stderr.txt"
    assert f"(all output: {log})" in err[0] and "the steps refused this" in log.read_text()
    record = json.loads(out.read_text())
    assert record["derived"]["step_s"] > 0 and "validation" not in record


@pytest.mark.slow
def test_runs_of_two_dtypes_need_dtype_said(tiny_run: Path, tmp_path: Path, capsys):
    """Predicting from the rows of one dtype of two, unasked, would be a silent choice: both commands refuse
    in one line naming dtype=, and take the runs once it is given."""
    bf16_run = tmp_path / "bf16"
    ops = "ops=[embedding,transformer_layer,final_layernorm,output_layer]"
    argv = ["case=tiny", ops, "shapes.seq_len=[32]", "shapes.micro_batch_size=[1]", "dtype=bf16", *FAST]
    assert run([*argv, "report=false", f"hydra.run.dir={bf16_run}"]) == 0
    runs = [str(tiny_run), str(bf16_run)]
    layout = ["seq_len=32", "micro_batch_size=1", "global_batch_size=2", "report=false"]
    out = tmp_path / "prediction.json"
    for main, args in (
        (predict_main, [*runs, *layout, f"json={out}"]),
        (tune_main, [*runs, "gpus=1", "gpu_memory_gb=1", "global_batch_size=2", "seq_len=32"]),
    ):
        capsys.readouterr()
        assert main(args) == 2, args
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "the runs hold rows in bf16 and fp32" in err, err
        assert "dtype=bf16" in err
    assert not out.exists()
    assert predict_main([*runs, *layout, "dtype=fp32", f"json={out}"]) == 0
    assert json.loads(out.read_text())["layout"]["dtype"] == "fp32"
    assert (
        tune_main([*runs, "gpus=1", "gpu_memory_gb=1", "global_batch_size=2", "seq_len=32", "dtype=bf16"])
        == 0
    )


@pytest.mark.slow
def test_predict_sends_a_validation_to_autotuner_validate(tiny_run: Path, capsys):
    """The real steps are autotuner.validate's: autotuner-predict has no validate= setting and its help
    names the command that has."""
    argv = [str(tiny_run), "seq_len=32", "global_batch_size=2", "dtype=fp32", "report=false"]
    assert predict_main([*argv, "validate=true"]) == 2
    assert "unknown setting 'validate'" in capsys.readouterr().err
    for main, said in (
        (predict_main, "autotuner-validate takes the same settings"),
        (validate_main, "repeats=N"),
    ):
        with pytest.raises(SystemExit) as ended:
            main(["--help"])
        assert ended.value.code == 0 and said in capsys.readouterr().out
