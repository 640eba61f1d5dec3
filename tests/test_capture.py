"""Capture a real training run's calls and profile exactly those (autotuner.capture)."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from autotuner.capture import capture
from autotuner.capture.megatron import megatron_calls
from autotuner.capture.recorder import EAGER_NOTE
from autotuner.capture.schema import load
from autotuner.errors import UserError
from autotuner.main import run
from autotuner.ops_test.base import ShapePoint
from autotuner.results import load_rows

REPO = Path(__file__).resolve().parents[1]
FAST = ["timing.warmup=1", "timing.min_samples=2", "timing.max_samples=3", "progress=false", "report=false"]

LLAMA_SCRIPT = """
import sys
import torch
from transformers import LlamaConfig, LlamaForCausalLM

torch.manual_seed(0)
config = LlamaConfig(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=256, max_position_embeddings=64)
model = LlamaForCausalLM(config)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
ids = torch.randint(0, 256, (2, 16))
for step in range(int(sys.argv[1])):
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    print(f"step {step} loss {loss.item():.3f}")
"""


def _capture_cli(out: Path, *command: str, steps: str | None = None, **kwargs) -> subprocess.Popen:
    window = [f"steps={steps}"] if steps else []
    argv = [sys.executable, "-m", "autotuner.capture", f"out={out}", *window, "--", *command]
    return subprocess.Popen(
        argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs
    )


def _shapes(record) -> list:
    return [a["tensor"]["shape"] for a in record.args if "tensor" in a]


@pytest.fixture(scope="module")
def llama_capture(tmp_path_factory) -> Path:
    """A tiny transformers Llama trained 3 steps under the CLI; steps 1 and 2 captured."""
    folder = tmp_path_factory.mktemp("llama")
    (folder / "train.py").write_text(LLAMA_SCRIPT)
    out = folder / "shapes.json"
    proc = _capture_cli(out, "python", str(folder / "train.py"), "3", steps="1:3")
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr
    assert stdout.splitlines()[0].startswith("step 0 loss") and "step 2 loss" in stdout
    assert "autotuner.capture: " in stderr.splitlines()[-1]
    return out


@pytest.mark.slow
def test_llama_capture_holds_linear_attention_norm_activation(llama_capture: Path):
    cap = load(llama_capture)
    assert (cap.status, cap.steps_seen, cap.steps_captured) == ("complete", 3, 2)
    assert cap.environment["torch"] == torch.__version__
    by_path = {(r.callee, r.path): r for r in cap.calls}
    # Every call once per step: two steps in the window gives 2 (step 0 is outside it).
    assert {r.count for r in cap.calls} == {2}
    q_proj = by_path["torch.nn.functional.linear", "model.layers.0.self_attn.q_proj"]
    assert _shapes(q_proj) == [[2, 16, 64], [64, 64]] and q_proj.args[1]["tensor"]["parameter"]
    assert _shapes(by_path["torch.nn.functional.linear", "model.layers.1.self_attn.k_proj"]) == [
        [2, 16, 64],
        [32, 64],
    ]
    assert _shapes(by_path["torch.nn.functional.linear", "model.layers.1.mlp.down_proj"])[0] == [2, 16, 176]
    linear = by_path["torch.nn.modules.linear.Linear", "model.layers.0.mlp.gate_proj"]
    assert linear.attrs["in_features"] == 64 and linear.attrs["out_features"] == 176
    sdpa = by_path["torch.nn.functional.scaled_dot_product_attention", "model.layers.0.self_attn"]
    assert _shapes(sdpa) == [[2, 4, 16, 16], [2, 2, 16, 16], [2, 2, 16, 16]]
    assert sdpa.kwargs["is_causal"] == {"value": True}
    norms = [r for r in cap.calls if r.class_name == "LlamaRMSNorm"]
    assert len(norms) == 5 and all(_shapes(r) == [[2, 16, 64]] for r in norms)
    assert norms[0].attrs["weight_shape"] == [64] and norms[0].attrs["variance_epsilon"] == 1e-6
    silu = [r for r in cap.calls if r.callee == "torch.nn.functional.silu"]
    assert [_shapes(r) for r in silu] == [[[2, 16, 176]]] * 2
    loss = by_path["torch.nn.functional.cross_entropy", ""]
    assert _shapes(loss) == [[32, 256], [32]]


@pytest.mark.slow
def test_llama_capture_replays_with_get_data(llama_capture: Path, tmp_path: Path, capsys):
    assert run([f"capture={llama_capture}", "device=cpu", f"hydra.run.dir={tmp_path}", *FAST]) == 0
    rows = load_rows(tmp_path / "results.jsonl")
    assert all(r["status"] == "ok" for r in rows), [r for r in rows if r["status"] != "ok"]
    counts = {(r["op"].rsplit("_", 1)[0], r["point"]): r["call_count"] for r in rows}
    # q_proj and o_proj share a signature: 2 layers x 2 modules x 2 steps.
    assert counts["f_linear", "f32_2x16x64,f32_64x64"] == 8
    assert counts["f_linear", "f32_2x16x64,f32_256x64"] == 2  # lm_head
    assert counts["m_llamarmsnorm", "f32_2x16x64"] == 10  # replayed as torch's RMSNorm (see notes)
    assert counts["f_silu", "f32_2x16x176"] == 4
    sdpa = [k for k in counts if k[0] == "f_scaled_dot_product_attention"]
    assert len(sdpa) == 1 and sdpa[0][1].startswith("f32_2x4x16x16,f32_2x2x16x16,f32_2x2x16x16")
    phases = {(r["op"], r["phase"]) for r in rows}
    assert ("f_silu_0", "backward") in phases and ("f_embedding_0", "backward") in phases
    assert {r["case"] for r in rows} == {"capture:shapes"}
    assert "LlamaRMSNorm replayed as torch.nn.RMSNorm" in capsys.readouterr().err


@pytest.fixture(scope="module")
def megatron_capture(tiny_spec, tiny_session, tmp_path_factory) -> Path:
    """A GPTModel of case=tiny (its own, uninstrumented) trained 2 steps under the context manager."""
    from autotuner.model.build import ModelParts, build_model

    spec = tiny_spec
    model = build_model(spec.model_args, spec.tf_config, ModelParts(2, True, True), spec.device, False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    s, b = 48, 2  # not one of the case's own points, so replayed points come from the capture
    ids = torch.randint(0, spec.model_args.vocab_size, (b, s))
    positions = torch.arange(s).expand(b, -1)
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1)[None, None]
    out = tmp_path_factory.mktemp("megatron") / "gpt.json"
    with capture(out):
        for _ in range(2):
            model(ids, positions, attention_mask=mask, labels=ids).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
    return out


@pytest.mark.slow
def test_megatron_capture_maps_to_our_ops_and_points(megatron_capture: Path):
    calls = {c.op: c for c in megatron_calls(load(megatron_capture))}
    point = ShapePoint(48, 2)
    assert {c.point for c in calls.values()} == {point}
    layer = calls["transformer_layer"]
    assert layer.count == 4 and layer.paths == ["decoder.layers.0", "decoder.layers.1"]  # 2 layers x 2 steps
    assert layer.dims == {"hidden_size": 64}
    assert calls["core_attention"].dims == {"attention_heads": 4, "kv_channels": 16, "query_groups": 2}
    for op in ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "input_layernorm", "mlp"):
        assert calls[op].count == 4, op
    for op in ("embedding", "transformer_block", "final_layernorm", "output_layer"):
        assert calls[op].count == 2, op


@pytest.mark.slow
def test_megatron_capture_replays_at_exactly_its_points(megatron_capture: Path, tmp_path: Path):
    ops = "ops=[transformer_layer,linear_qkv,rope,embedding]"
    argv = ["case=tiny", "device=cpu", f"capture={megatron_capture}", ops, f"hydra.run.dir={tmp_path}"]
    assert run([*argv, *FAST]) == 0
    rows = load_rows(tmp_path / "results.jsonl")
    assert {r["point"] for r in rows} == {"s48_b2"} and len(rows) == 8
    assert all(r["status"] == "ok" for r in rows)
    counts = {r["op"]: r["call_count"] for r in rows}
    assert counts == {"transformer_layer": 4, "linear_qkv": 4, "rope": 4, "embedding": 2}


@pytest.mark.slow
def test_capture_of_another_model_is_refused(megatron_capture: Path):
    import autotuner.capture.replay  # noqa: F401  (registers capture=, as the entry points do)
    from autotuner.config import compose_config
    from autotuner.runner.spec import resolve_spec

    overrides = [
        "case=tiny",
        "device=cpu",
        f"capture={megatron_capture}",
        "hf.hidden_size=128",
        "hf.head_dim=32",
    ]
    with pytest.raises(UserError, match=r"another model.*hidden_size \[64\] \(case: 128\)"):
        resolve_spec(compose_config(overrides))


@pytest.mark.parametrize(
    "ending, code, status, error",
    [
        ('raise RuntimeError("boom in step 1")', 1, "exception", "RuntimeError: boom in step 1"),
        ("sys.exit(3)", 3, "exit", "SystemExit: 3"),
    ],
)
@pytest.mark.slow
def test_failing_script_passes_exit_code_and_output_through(tmp_path: Path, ending, code, status, error):
    script = tmp_path / "fails.py"
    script.write_text(
        textwrap.dedent(f"""
        import sys
        import torch
        print("before the failure")
        torch.nn.Linear(4, 3)(torch.randn(2, 4))
        {ending}
        """)
    )
    out = tmp_path / "partial.json"
    proc = _capture_cli(out, "python", str(script))
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == code and stdout == "before the failure\n"
    if status == "exception":
        assert "Traceback" in stderr and "RuntimeError: boom in step 1" in stderr
    cap = load(out)
    assert cap.status == status and cap.error == error
    assert [_shapes(r) for r in cap.calls if r.callee == "torch.nn.functional.linear"] == [
        [[2, 4], [3, 4], [3]]
    ]


@pytest.mark.slow
def test_sigterm_writes_the_capture_and_ends_by_the_signal(tmp_path: Path):
    script = tmp_path / "slow.py"
    script.write_text(
        "import time, torch\ntorch.nn.Linear(4, 3)(torch.randn(2, 4))\nprint('ready', flush=True)\n"
        "time.sleep(60)\n"
    )
    out = tmp_path / "killed.json"
    proc = _capture_cli(out, "python", str(script))
    assert proc.stdout.readline() == "ready\n"
    time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGTERM
    cap = load(out)
    assert cap.status == "signal" and cap.error == "terminated by SIGTERM" and cap.calls


def test_recorder_restores_everything_and_records_outer_calls_once(tmp_path: Path):
    modules = torch.nn.modules.module
    hooks = (len(modules._global_forward_hooks), len(modules._global_forward_pre_hooks))
    originals = (F.linear, F.softmax, torch.Tensor.softmax)
    x = torch.randn(3, 5)
    with pytest.raises(ValueError, match="stop here"), capture(tmp_path / "c.json") as recorder:
        F.softmax(x, dim=-1)  # calls Tensor.softmax inside: one record, the outer one
        x.softmax(0)
        torch.nn.Linear(5, 2)(x)
        raise ValueError("stop here")
    assert (F.linear, F.softmax, torch.Tensor.softmax) == originals and "softmax" not in vars(torch.Tensor)
    assert (len(modules._global_forward_hooks), len(modules._global_forward_pre_hooks)) == hooks
    callees = sorted((r.callee, r.count) for r in recorder.records())
    assert callees == [
        ("torch.Tensor.softmax", 1),
        ("torch.nn.functional.linear", 1),
        ("torch.nn.functional.softmax", 1),
        ("torch.nn.modules.linear.Linear", 1),
    ]
    assert load(tmp_path / "c.json").error == "ValueError: stop here"


class _Scale(torch.nn.Module):
    def forward(self, x):
        return x * 2


class _SharedRotary(torch.nn.Module):
    """One instance every layer calls and no layer holds, as transformers 5.25 makes of
    ``apply_rotary_pos_emb``; it holds a child of its own."""

    def __init__(self):
        super().__init__()
        self.scale = _Scale()

    def forward(self, x):
        return self.scale(x)


SHARED_ROTARY = _SharedRotary()


class _Layer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)

    def forward(self, x):
        return SHARED_ROTARY(self.proj(x))


def test_a_module_no_layer_holds_is_named_where_each_layer_calls_it(tmp_path: Path):
    model = torch.nn.Sequential(_Layer(), _Layer())
    with capture(tmp_path / "c.json", functions=[], methods=[]):
        for _ in range(2):
            model(torch.randn(3, 4))
    counts = {(r.class_name, r.path): r.count for r in load(tmp_path / "c.json").calls}
    # Named at its first caller, the shared module's calls from layer 1 would count as layer 0's (4 and 4).
    assert counts == {
        ("Sequential", ""): 2,
        **{("_Layer", f"{i}"): 2 for i in (0, 1)},
        **{("Linear", f"{i}.proj"): 2 for i in (0, 1)},
        **{("_SharedRotary", f"{i}.~_SharedRotary"): 2 for i in (0, 1)},
        **{("_Scale", f"{i}.~_SharedRotary.scale"): 2 for i in (0, 1)},
    }


def test_a_compiled_model_is_captured_as_its_eager_self(tmp_path: Path):
    """Under torch.compile, dynamo traced into the global module hooks and raised AssertionError
    ("already tracked for mutation"): 0 calls captured. While capturing, the compiled model runs eagerly:
    its capture lists the calls the model run eagerly gives, under the same names, and says so."""

    def train(model: torch.nn.Module) -> None:
        for _ in range(2):
            F.silu(model(torch.randn(3, 4))).sum().backward()

    model = torch.nn.Sequential(_Layer(), _Layer())
    found, settings = {}, {}
    for how, run_model in (("eager", model), ("compiled", torch.compile(model))):
        with capture(tmp_path / f"{how}.json"):
            train(run_model)
        cap = load(tmp_path / f"{how}.json")
        assert cap.status == "complete", cap.error
        found[how] = sorted((r.callee, r.path, r.count, str(_shapes(r))) for r in cap.calls)
        settings[how] = cap.settings.get("torch_compile")
    assert found["compiled"] == found["eager"]
    assert ("torch.nn.functional.linear", "1.proj", 2, "[[3, 4], [4, 4], [4]]") in found["compiled"]
    assert settings == {"eager": None, "compiled": EAGER_NOTE}


def test_replayed_inputs_keep_the_recorded_strides(tmp_path: Path):
    from autotuner.capture.generic import GenericOp, distinct_calls
    from autotuner.capture.replay import GenericContext

    base = torch.randn(6, 8, requires_grad=True)
    functions = ["softmax", "silu", "gelu"]
    with capture(tmp_path / "a.json", functions=functions, methods=[]):
        F.softmax(base.t(), dim=-1)  # dense but transposed
        F.silu(base[:, ::2])  # gaps between rows
        F.gelu(base[:1].expand(4, 8))  # overlapping (stride 0)
    recorded = load(tmp_path / "a.json")
    cpu = torch.device("cpu")
    with capture(tmp_path / "b.json", functions=functions, methods=[]):  # records what replay calls
        ops = [GenericOp(f"op_{i}", call, cpu, None) for i, call in enumerate(distinct_calls(recorded))]
        context = GenericContext(torch.nn.ModuleDict({op.name: op.make_weights(0) for op in ops}), cpu, 0)
        for op in ops:
            call = op(context, ShapePoint(1, 1))
            call.fn(*call.inputs).sum().backward()
    replayed = load(tmp_path / "b.json")
    assert [(r.callee, r.args, r.kwargs) for r in replayed.calls] == [
        (r.callee, r.args, r.kwargs) for r in recorded.calls
    ]


@pytest.mark.parametrize(
    "content, message",
    [
        ("{not json", "not valid JSON (line 1 column 2)"),
        ('{"format": "autotuner-capture", "version": 99, "calls": []}', "has version 99"),
        ('{"format": "something-else"}', "is not an autotuner capture"),
    ],
)
def test_bad_capture_file_is_one_line_error(tmp_path: Path, capsys, content, message):
    bad = tmp_path / "bad.json"
    bad.write_text(content)
    assert run([f"capture={bad}", "device=cpu", f"hydra.run.dir={tmp_path}"]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("autotuner: error")]
    assert len(errors) == 1 and message in errors[0] and str(bad) in errors[0]
    with pytest.raises(UserError) as raised:
        load(bad)
    assert message in str(raised.value) and "\n" not in str(raised.value)
