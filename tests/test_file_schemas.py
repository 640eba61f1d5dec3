"""User files checked by their schemas (pydantic): every refusal is one line naming the file, the field
and its problem, and the fix; a good file loads as before."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from autotuner.capture.schema import FORMAT, VERSION, load
from autotuner.errors import UserError
from autotuner.model import cases


@pytest.mark.parametrize(
    "text, words",
    [
        ("hf_config: {1: 2}\n", ("hf_config key 1 must be a string, not int", "write it as model_type")),
        ("hf_config_dir: 5\n", ("hf_config_dir must be a string, not int 5", "folder holding config.json")),
        ("hf_config_dir: ''\n", ("hf_config_dir must not be empty", "folder holding config.json")),
        ("hf_config: {model_type: llama}\nshapes: [8]\n", ("shapes must be a mapping, not list", "seq_len")),
        ("hf_config: {model_type: llama}\ndescription: [1]\n", ("description must be a string",)),
        (
            "hf_config: {model_type: llama}\nshape: {}\nnote: x\n",
            ("unknown key(s) shape, note", "allowed keys are description, hf_config"),
        ),
    ],
)
def test_case_file_refusals_name_the_field_and_the_fix(tmp_path: Path, text: str, words: tuple[str, ...]):
    (tmp_path / "bad.yaml").write_text(text)
    with pytest.raises(UserError) as raised:
        cases.load_case("bad", str(tmp_path))
    message = str(raised.value)
    assert "\n" not in message and message.startswith(f"case file {tmp_path / 'bad.yaml'}: ")
    for word in words:
        assert word in message, message


def test_case_file_description_and_shapes_load(tmp_path: Path):
    (tmp_path / "ok.yaml").write_text(
        "description: 7\nnotes: [anything]\nhf_config: {model_type: llama}\nshapes: {seq_len: [8]}\n"
    )
    case = cases.load_case("ok", str(tmp_path))
    assert case.description == "7" and case.shapes == {"seq_len": [8]}
    assert case.hf_fields == {"model_type": "llama"}


GOOD = {
    "format": FORMAT,
    "version": VERSION,
    "created": "2026-01-31T12:00:00+00:00",
    "command": ["train.py"],
    "environment": {"torch": "2.13.0"},
    "settings": {"steps": [1, 3], "functions": ["torch.nn.functional.linear"], "methods": []},
    "steps": {"seen": 3, "captured": 2},
    "status": "complete",
    "error": None,
    "calls": [
        {
            "kind": "module",
            "callee": "torch.nn.modules.linear.Linear",
            "base": "torch.nn.modules.linear.Linear",
            "path": "model.proj",
            "args": [{"tensor": {"shape": [2, 4], "dtype": "float32"}}],
            "kwargs": {},
            "attrs": {"in_features": 4},
            "training": True,
            "grad_enabled": True,
            "count": 2,
        },
        {"kind": "function", "callee": "f", "path": "", "args": [], "kwargs": {}, "count": 1},
    ],
}


def test_a_good_capture_loads(tmp_path: Path):
    path = tmp_path / "ok.json"
    path.write_text(json.dumps(GOOD))
    capture = load(path)
    assert capture.window == (1, 3) and (capture.steps_seen, capture.steps_captured) == (3, 2)
    assert capture.settings["functions"] == ["torch.nn.functional.linear"]
    module, function = capture.calls
    assert module.attrs == {"in_features": 4} and module.base_name == "Linear" and module.count == 2
    assert function.attrs == {} and function.grad_enabled and function.training is None


@pytest.mark.parametrize(
    "change, words",
    [
        (lambda d: d["calls"][1].update(count=0), "calls[1].count must be at least 1, not 0"),
        (lambda d: d["calls"][1].update(count=True), "calls[1].count must be an integer, not bool"),
        (lambda d: d["calls"][0].pop("callee"), "calls[0].callee is missing"),
        (lambda d: d["calls"][0].update(kind="class"), "calls[0].kind must be one of 'module'"),
        (lambda d: d["calls"].append(5), "calls[2] must be a mapping, not int 5"),
        (lambda d: d.update(calls={}), "calls must be a list, not dict"),
        (
            lambda d: d["settings"].update(steps=[1, 2, 3]),
            "settings.steps must have at most 2 item(s), not 3",
        ),
        (lambda d: d.update(status="finished"), "status must be one of 'complete'"),
    ],
)
def test_capture_refusals_name_the_field(tmp_path: Path, change, words: str):
    data = copy.deepcopy(GOOD)
    change(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(UserError) as raised:
        load(path)
    message = str(raised.value)
    assert "\n" not in message and message.startswith(f"capture file {path}: ")
    assert words in message and message.endswith("capture it again with python -m autotuner.capture")


@pytest.mark.parametrize(
    "change, words",
    [
        (lambda d: d.update(adam_parameters="many"), "adam_parameters must be a number, not str 'many'"),
        (lambda d: d.update(memory_bandwidth=True), "memory_bandwidth must be a number, not bool True"),
        (lambda d: d["peak_flops"].update(bf16="fast"), "peak_flops.bf16 must be a number, not str 'fast'"),
        (lambda d: d.update(zeroing_bandwidth=None), "zeroing_bandwidth must be a number, not NoneType"),
        (lambda d: d.update(adam_seconds_per_tensor=-1), "adam_seconds_per_tensor must be at least 0"),
        (lambda d: d.pop("memory_bandwidth"), "memory_bandwidth is missing (bytes/s)"),
        (lambda d: d.update(environment=[1]), "environment must be a mapping, not list"),
        (
            lambda d: d.update(all_reduce_bandwidth={"nccl:8": "x"}),
            "all_reduce_bandwidth.nccl:8 must be a number, not str 'x'",
        ),
    ],
)
def test_calibration_refusals_name_the_field(tmp_path: Path, change, words: str, capsys):
    """A calibration file of the wrong types is refused where it is read, in one line naming the field (it
    passed, and a prediction then failed on it with a traceback)."""
    from autotuner.predict.__main__ import main as predict_main
    from autotuner.results.calibration import load as load_calibration

    fixture = Path(__file__).parent / "fixtures" / "h200_llama7b" / "profile"
    data = json.loads((fixture / "calibration.json").read_text())
    change(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(UserError) as raised:
        load_calibration(path)
    message = str(raised.value)
    assert "\n" not in message and message.startswith(f"calibration file {path}: ")
    assert words in message and "autotuner.calibrate" in message, message
    out = tmp_path / "p.json"
    assert (
        predict_main([str(fixture), "seq_len=2048", "report=false", f"calibration={path}", f"json={out}"])
        == 2
    )
    err = capsys.readouterr().err.strip()
    assert err == f"autotuner-predict: error: {message}" and not out.exists()
