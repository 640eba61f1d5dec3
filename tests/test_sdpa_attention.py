"""attention=sdpa: torch's scaled_dot_product_attention in Megatron's core_attention slot, against
Megatron-Core's own DotProductAttention, and as the tool measures it."""

import dataclasses
import json

import pytest
import torch

from tests.conftest import FAST


def _pair(config, layer_number):
    """Megatron's local DotProductAttention and the sdpa one, built alike from ``config``."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from autotuner.model.sdpa_attention import sdpa_attention

    args = (config, layer_number, AttnMaskType.causal, "self")
    return DotProductAttention(*args), sdpa_attention(DotProductAttention)(*args)


@pytest.mark.parametrize(
    ("groups", "layer_scaling"),
    [(4, False), (2, False), (1, True)],
    ids=["mha", "gqa", "mqa_query_key_layer_scaling"],
)
def test_sdpa_equals_megatrons_dot_product_attention(tiny_session, tiny_spec, groups, layer_scaling):
    """Outputs and the gradients of q, k and v equal in fp32, causal, with k and v of fewer heads (GQA,
    which the local one repeats and sdpa does not) and with query-key layer scaling at layer 3 (the
    local attention divides its scale by 3 and its softmax multiplies by 3 again)."""
    from megatron.core.transformer.enums import AttnMaskType

    config = dataclasses.replace(
        tiny_spec.tf_config,
        num_query_groups=groups,
        apply_query_key_layer_scaling=layer_scaling,
        attention_dropout=0.0,
    )
    local, sdpa = _pair(config, layer_number=3)
    assert sdpa.softmax_scale == pytest.approx(16**-0.5)
    s, b, heads, d = 48, 2, config.num_attention_heads, config.kv_channels
    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randn(s, b, n, d, generator=gen) for n in (heads, groups, groups)]
    grad = torch.randn(s, b, heads * d, generator=gen)
    mask = torch.ones(1, 1, s, s, dtype=torch.bool).triu(1)  # True: masked
    results = []
    for module in (local, sdpa):
        q, k, v = (t.clone().requires_grad_() for t in tensors)
        out = module(q, k, v, mask, attn_mask_type=AttnMaskType.causal)
        out.backward(grad)
        results.append((out.detach(), q.grad, k.grad, v.grad))
    for got, want, name in zip(results[1], results[0], ("output", "dq", "dk", "dv"), strict=True):
        assert got.shape == want.shape, name
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=name)


def test_sdpa_equals_the_local_mla_attention(tiny_session):
    """Multi-Latent Attention's core attention (q and k 24 wide, v 16; a softmax scale passed in, as
    MLA passes its own): sdpa equals the local one in fp32, forward and gradients, and on a CPU runs
    torch's math path (its CPU flash kernel takes one head width for q, k and v)."""
    from megatron.core.transformer.enums import AttnMaskType

    from autotuner.config import compose_config
    from autotuner.model.build import _local_mla_core_attention
    from autotuner.model.sdpa_attention import sdpa_attention, sdpa_backend
    from autotuner.runner.spec import resolve_spec

    config = dataclasses.replace(
        resolve_spec(compose_config(["case=tiny_mla", "device=cpu"])).tf_config, attention_dropout=0.0
    )
    local_class = _local_mla_core_attention()
    kw = {"softmax_scale": 0.3, "k_channels": 24, "v_channels": 16}
    args = (config, 1, AttnMaskType.causal, "self")
    local, sdpa = local_class(*args, **kw), sdpa_attention(local_class)(*args, **kw)
    s, b = 32, 2
    gen = torch.Generator().manual_seed(1)
    tensors = [torch.randn(s, b, 4, d, generator=gen) for d in (24, 24, 16)]
    mask = torch.ones(1, 1, s, s, dtype=torch.bool).triu(1)
    results = []
    for module in (local, sdpa):
        q, k, v = (t.clone().requires_grad_() for t in tensors)
        out = module(q, k, v, mask, attn_mask_type=AttnMaskType.causal)
        out.backward(torch.ones_like(out))
        results.append((out.detach(), q.grad, k.grad, v.grad))
    for got, want in zip(*reversed(results), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert sdpa_backend(lambda: sdpa(*tensors, None)) == "math"


def test_the_backend_is_the_operator_that_ran(tiny_session, tiny_spec):
    """The probe names the kernel the dispatcher called: the one torch's own selection picks for these
    inputs, and math where sdpa_kernel allows math only."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from autotuner.model.sdpa_attention import sdpa_backend

    _, sdpa = _pair(dataclasses.replace(tiny_spec.tf_config, attention_dropout=0.0), 1)
    q, k, v = (torch.randn(32, 2, n, 16, requires_grad=True) for n in (4, 2, 2))
    call = lambda: sdpa(q, k, v, None)  # noqa: E731
    chosen = torch._fused_sdp_choice(
        *(t.permute(1, 2, 0, 3) for t in (q, k, v)), is_causal=True, scale=sdpa.softmax_scale, enable_gqa=True
    )
    names = {"FLASH_ATTENTION": "flash", "EFFICIENT_ATTENTION": "efficient", "CUDNN_ATTENTION": "cudnn"}
    assert sdpa_backend(call) == names.get(SDPBackend(chosen).name, SDPBackend(chosen).name.lower())
    with sdpa_kernel([SDPBackend.MATH]):
        assert sdpa_backend(call) == "math"


def _measure(run_dir, *settings):
    """get_data's core_attention rows at s256_b1 by phase, and the run's environment.json."""
    from autotuner.main import run

    argv = ["case=tiny", "launcher=get_data", f"hydra.run.dir={run_dir}", "ops=[core_attention]"]
    shapes = ["shapes.seq_len=[256]", "shapes.micro_batch_size=[1]", "report=false"]
    assert run([*argv, *shapes, *settings, *FAST]) == 0
    rows = {r["phase"]: r for r in map(json.loads, (run_dir / "results.jsonl").read_text().splitlines())}
    return rows, json.loads((run_dir / "environment.json").read_text())


B, HEADS, S, D = 1, 4, 256, 16  # the tiny case's attention at s256_b1
PRODUCT = 2 * B * HEADS * S * S * D  # the FLOPs of one [s, d] x [d, s] product per head


def _check_no_scores_and_flops(local, sdpa, element_bytes):
    """sdpa's forward saved none of the b x heads x s x s probabilities the local one saved; its FLOPs
    are the local's forward (two products) and a fused kernel's backward (five, the scores recomputed)."""
    scores = B * HEADS * S * S * element_bytes
    assert local["forward"]["activation_bytes"] - sdpa["forward"]["activation_bytes"] >= scores
    assert sdpa["forward"]["activation_bytes"] < scores / 2
    assert local["forward"]["flops"] == sdpa["forward"]["flops"] == 2 * PRODUCT
    assert local["backward"]["flops"] == 4 * PRODUCT
    assert sdpa["backward"]["flops"] == 5 * PRODUCT


@pytest.fixture(scope="module")
def core_attention_rows(tmp_path_factory):
    """core_attention measured by get_data with attention=local and attention=sdpa (here: a CPU)."""
    rows = {}
    for attention in ("local", "sdpa"):
        rows[attention], record = _measure(tmp_path_factory.mktemp(attention), f"attention={attention}")
        assert record["attention"] == attention
    return rows


@pytest.mark.slow
def test_sdpa_saves_no_scores_and_counts_the_attention_flops(core_attention_rows):
    """The tool's own activation bytes and FLOPs on a CPU, fp32: the local attention's saved bytes hold
    the probabilities, sdpa's (its inputs, output and one log-sum-exp per query row) do not."""
    local, sdpa = core_attention_rows["local"], core_attention_rows["sdpa"]
    assert {r["attention_backend"] for r in local.values()} == {"local"}
    assert {r["attention_backend"] for r in sdpa.values()} == {"flash"}  # torch's CPU flash kernel
    _check_no_scores_and_flops(local, sdpa, element_bytes=4)


@pytest.mark.gpu
def test_on_a_gpu_without_te_sdpa_is_the_default_and_runs_a_fused_kernel(tmp_path):
    """On CUDA in bf16: attention=auto builds sdpa where Transformer-Engine does not import, sdpa runs
    one of torch's fused kernels, and the figures hold as on the CPU."""
    from autotuner.model.build import transformer_engine_available

    auto, record = _measure(tmp_path / "auto", "device=cuda")
    assert record["attention"] == ("te" if transformer_engine_available() else "sdpa")
    local, _ = _measure(tmp_path / "local", "device=cuda", "attention=local")
    sdpa, _ = _measure(tmp_path / "sdpa", "device=cuda", "attention=sdpa")
    assert {r["attention_backend"] for r in sdpa.values()} <= {"flash", "efficient", "cudnn"}
    _check_no_scores_and_flops(local, sdpa, element_bytes=2)


def test_auto_is_local_on_a_cpu(tiny_spec):
    assert tiny_spec.attention == "local"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["attention=sdpa", "tf.window_size=[16,0]"], "attention=sdpa: window_size=(16, 0) (sliding-window"),
        (["attention=sdpa", "tf.attention_softcap=50.0"], "attention=sdpa: attention_softcap=50.0"),
        (["attention=te"], "attention=te needs Transformer-Engine's layer spec"),
        (["attention=flash"], "attention='flash' is not one of auto, local, sdpa, te"),
    ],
)
def test_what_sdpa_cannot_express_is_refused_in_one_line(overrides, message, capsys, tmp_path):
    from autotuner.main import run

    assert run(["case=tiny", f"hydra.run.dir={tmp_path}", *overrides]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("autotuner: error:") and message in err[0], err


def test_a_mask_that_is_not_causal_is_refused_at_construction(tiny_session, tiny_spec):
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from autotuner.model.sdpa_attention import sdpa_attention

    with pytest.raises(ValueError, match="attention=sdpa: attn_mask_type=padding"):
        sdpa_attention(DotProductAttention)(tiny_spec.tf_config, 1, AttnMaskType.padding, "self")


def test_the_dry_run_says_it_previews_the_local_attention(capsys, tmp_path):
    from autotuner.main import run

    argv = ["case=tiny", "dry_run=true", "ops=[core_attention]", f"hydra.run.dir={tmp_path}"]
    assert run([*argv, "attention=sdpa"]) == 0
    assert "core_attention is previewed as the local attention, the run builds attention=sdpa" in (
        capsys.readouterr().out
    )


def test_the_ops_holding_the_attention_say_which_ran(tiny_session):
    """self_attention, transformer_layer and transformer_block state the attention_backend their core
    attention ran, as core_attention does (here the CPU's default, the local attention)."""
    from autotuner.op_mapping import resolve_ops
    from autotuner.ops_test.base import ShapePoint

    _, ctx = tiny_session
    point = ShapePoint(32, 2)
    for op in resolve_ops(["core_attention", "self_attention", "transformer_layer", "transformer_block"]):
        assert op.build(ctx, point).row_fields == {"attention_backend": "local"}, op.name
