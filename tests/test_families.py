"""The supported model families (autotuner.model.families), proved against transformers' own models.

* Every field of each family's config class has a rule (mapped, irrelevant, noted), and the rule says what
  the mapping does: changing a mapped field changes the Megatron arguments (or is refused), changing an
  irrelevant one changes nothing, a noted one is noted.
* Each family's published config (cases/hf/<model>/config.json, as published, with its source in the case
  file) builds the same parameters as transformers' model of it on the meta device: in total, active (less
  the routed experts a token does not reach), and layer by layer.
* Each MoE family's router routes as transformers' router of the family does (the same experts, the same
  weights), DeepSeek-V3's with its sigmoid scores, expert bias, groups and scaling.
* The pieces the layer spec adds compute what transformers' modules compute.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from autotuner.errors import UserError
from autotuner.model import cases
from autotuner.model.families import FAMILIES, Family
from autotuner.model.hf_to_megatron import map_hf_config

REPO = Path(__file__).resolve().parents[1]
META = torch.device("meta")


def _published_cases() -> dict[str, str]:
    """model_type -> the shipped case holding its published config (every family has one)."""
    found: dict[str, str] = {}
    for name in cases.available_cases():
        case = cases.load_case(name)
        model_type = case.hf_fields.get("model_type")
        if case.path.read_text().find("hf_config_dir:") >= 0 and model_type in FAMILIES:
            found.setdefault(model_type, name)
    return found


PUBLISHED = _published_cases()


def _hf(fields: dict[str, Any], **overrides: Any) -> Any:
    return cases.build_hf_config({**fields, **overrides}, {})


def _config_class(family: Family) -> type:
    from transformers import AutoConfig

    return type(AutoConfig.for_model(family.model_type))


def _class_fields(family: Family) -> set[str]:
    """Every field of the family's config class: what it writes (to_dict), what its constructor takes
    and the other names it answers to (attribute_map)."""
    cls = _config_class(family)
    params = set(inspect.signature(cls.__init__).parameters) - {"self", "kwargs", "args"}
    return set(cls().to_dict()) | params | set(getattr(cls, "attribute_map", {}))


def test_every_published_family_is_covered():
    """The families the issue lists, each with a shipped case of a published config."""
    listed = {
        *("llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "deepseek_v2"),
        *("deepseek_v3", "gemma", "gemma2", "phi3", "olmoe", "granite", "granitemoe", "starcoder2"),
    }
    assert listed <= set(FAMILIES)
    assert set(FAMILIES) == set(PUBLISHED), set(FAMILIES) ^ set(PUBLISHED)


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_every_field_of_the_config_class_has_a_rule(model_type):
    family = FAMILIES[model_type]
    missing = sorted(name for name in _class_fields(family) if family.rule(name) is None)
    assert not missing, f"{model_type}: fields with no rule in autotuner/model/families.py: {missing}"


def test_an_unknown_model_type_is_refused_naming_the_supported_ones():
    with pytest.raises(UserError) as caught:
        map_hf_config(_hf({"model_type": "gpt_neox", "hidden_size": 64, "num_attention_heads": 4}))
    message = str(caught.value)
    assert "'gpt_neox' is not a supported family" in message and "\n" not in message
    assert all(name in message for name in FAMILIES)


# --- the rules say what the mapping does -------------------------------------------------------------

# Where a field matters only beside another (a window's layers only with the window in force), the
# context it is changed in; and values for fields the published config leaves at None.
CONTEXT: dict[str, dict[str, Any]] = {
    "max_window_layers": {"use_sliding_window": True, "sliding_window": 1024, "max_window_layers": 4},
    "use_sliding_window": {"sliding_window": 1024, "max_window_layers": 4},
    "sliding_window": {"use_sliding_window": True, "max_window_layers": 4},
    "layer_types": {"use_sliding_window": True, "sliding_window": 1024},
}
FAMILY_CONTEXT: dict[tuple[str, str], dict[str, Any]] = {
    ("deepseek_v2", "n_group"): {"topk_method": "group_limited_greedy"},
    ("deepseek_v2", "topk_group"): {"topk_method": "group_limited_greedy", "n_group": 8},
}
NONE_VALUES: dict[str, Any] = {
    "sliding_window": 1024,
    "q_lora_rank": 64,
    "clip_qkv": 8.0,
    "head_dim": 32,
    "num_key_value_heads": 1,
    "router_aux_loss_coef": 0.02,
    "attn_logit_softcapping": 40.0,
    "final_logit_softcapping": 20.0,
    "query_pre_attn_scalar": 144,
    "use_bidirectional_attention": True,
    "num_experts_per_tok": 1,
    "n_group": 4,
    "topk_group": 2,
    "layer_types": "flip",
    "pad_token_id": 0,
    "bos_token_id": 0,
    "eos_token_id": 0,
    "quantization_config": {"quant_method": "fp8"},
    "problem_type": "regression",
    "transformers_version": "4.0.0",
    "dtype": "float32",
}
STRINGS = {
    "hidden_act": ["silu", "gelu_pytorch_tanh"],
    "hidden_activation": ["gelu_pytorch_tanh", "silu"],
    "topk_method": ["greedy", "group_limited_greedy"],
    "model_type": None,
}


def _changed(name: str, value: Any, fields: dict[str, Any]) -> Any:
    """Another valid-looking value for field ``name`` (None where there is none to try)."""
    if value is None:
        chosen = NONE_VALUES.get(name)
        if chosen == "flip":
            return None
        return chosen
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value * 2
    if isinstance(value, float):
        return value * 0.5 if value else 0.1
    if isinstance(value, str):
        options = STRINGS.get(name) or []
        others = [o for o in options if o != value]
        return others[0] if others else value + "_other"
    if isinstance(value, list):
        if name == "layer_types":
            return ["sliding_attention" if t == "full_attention" else "full_attention" for t in value]
        if name == "mlp_only_layers":
            return [0]
        return None
    if isinstance(value, dict):
        changed = copy.deepcopy(value)
        if "rope_theta" in changed:
            changed["rope_theta"] = changed["rope_theta"] * 2
        elif "quant_method" in changed:
            changed["quant_method"] = "other"
        else:
            return None
        return changed
    return None


def _mapping(fields: dict[str, Any]) -> tuple[Any, list[str]] | str:
    """The Megatron arguments and notes of ``fields``, or the refusal's text."""
    try:
        args = map_hf_config(_hf(fields))
    except UserError as exc:
        return str(exc)
    shape = dataclasses.asdict(args)
    notes = shape.pop("notes")
    return shape, notes


def _rule_cases() -> list[tuple[str, str]]:
    found = []
    for model_type, family in sorted(FAMILIES.items()):
        for name in sorted(_class_fields(family)):
            rule = family.rule(name)
            if rule is not None and name != "model_type":
                found.append((model_type, name))
    return found


@pytest.mark.parametrize(("model_type", "name"), _rule_cases())
def test_the_rule_of_each_field_is_what_the_mapping_does(model_type, name):
    """Changing a field, in the family's published config: a mapped one changes the Megatron arguments or
    is refused; an irrelevant one changes nothing; a noted one adds a note naming it."""
    family = FAMILIES[model_type]
    published = cases.load_case(PUBLISHED[model_type]).hf_fields
    base = {**published, **CONTEXT.get(name, {}), **FAMILY_CONTEXT.get((model_type, name), {})}
    if name == "rope_parameters":  # the older spellings, where a file has them, win over it
        base = {k: v for k, v in base.items() if k not in ("rope_theta", "rope_scaling")}
    before = _mapping(base)
    assert not isinstance(before, str), before
    current = getattr(_hf(base), name, None)
    value = _changed(name, current, base)
    assert value is not None or current is not None, f"{name}: give the test a value to try (NONE_VALUES)"
    after = _mapping({**base, name: value})
    rule = family.rule(name)
    assert rule is not None
    name = rule.alias_of or name  # a note names the field by its own name
    if rule.kind == "mapped":
        assert isinstance(after, str) or after[0] != before[0], f"{name}={value!r} changed no argument"
    elif rule.kind == "irrelevant":
        assert after == before, f"{name}={value!r} changed the mapping of a field said to be irrelevant"
    else:
        notes = after if isinstance(after, str) else " ".join(after[1] + before[1])
        assert name in notes or (rule.refused and isinstance(after, str)), f"{name}={value!r}: no note"


# --- the counts are transformers' model's --------------------------------------------------------------


def _hf_model(hf_config: Any) -> Any:
    from transformers import AutoModelForCausalLM

    with torch.device(META):
        return AutoModelForCausalLM.from_config(hf_config)


def _numel(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _hf_counts(model: Any, hf_config: Any) -> tuple[int, int, list[int]]:
    """(total, active, each decoder layer's) parameters of transformers' model: active is the total less,
    in each MoE layer, the routed experts a token does not reach (its experts' modules, whose class
    names end in Experts, hold every routed expert; the router sends a token to top-k of them)."""
    total = _numel(model)
    layers = [_numel(layer) for layer in model.model.layers]
    active = total
    topk = hf_config.num_experts_per_tok if hasattr(hf_config, "num_experts_per_tok") else None
    for layer in model.model.layers:
        experts = [m for m in layer.modules() if type(m).__name__.endswith("Experts")]
        for module in experts:
            count = getattr(module, "num_experts", None) or module.weight.shape[0]
            active -= _numel(module) // count * (count - topk)
    return total, active, layers


def _ours(hf_config: Any) -> tuple[Any, Any]:
    from autotuner.model.build import build_transformer_config
    from autotuner.model.counts import count_parameters
    from autotuner.model.runtime import quiet_megatron_import

    quiet_megatron_import()
    args = map_hf_config(hf_config)
    tf = build_transformer_config(args, {}, "fp32", torch.device("cpu"), 1)
    counts = count_parameters(args, tf)
    return args, tf, counts


@pytest.mark.parametrize("model_type", sorted(PUBLISHED))
def test_published_config_counts_as_transformers_model_does(model_type):
    """Total, active and per-layer parameters of our Megatron model equal transformers' model of the same
    published config, built on the meta device (no weights, no download)."""
    hf_config = _hf(cases.load_case(PUBLISHED[model_type]).hf_fields)
    total, active, layers = _hf_counts(_hf_model(hf_config), hf_config)
    _, _, counts = _ours(hf_config)
    assert (counts.total, counts.active) == (total, active)
    assert [counts.layer(moe).parameters for moe in counts.layers] == layers


# --- the pieces the layer spec adds compute what transformers' modules compute ---------------------------


def test_zero_centred_norm_is_gemmas():
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm

    from autotuner.model.layer_parts import ZeroCenteredRMSNorm

    ours, theirs = ZeroCenteredRMSNorm(None, 24, eps=1e-6), GemmaRMSNorm(24, eps=1e-6)
    weight = torch.randn(24, generator=torch.Generator().manual_seed(1))
    ours.weight.data.copy_(weight)
    theirs.weight.data.copy_(weight)
    x = torch.randn(3, 2, 24, generator=torch.Generator().manual_seed(2))
    assert torch.equal(ours(x), theirs(x))


def test_projection_qk_norms_are_olmoes():
    """OLMoE normalises q over every head at once (and k over its heads): the norm Megatron builds per head
    here takes q as [s, b, heads, head_dim] and gives what OlmoeRMSNorm gives on [s, b, heads x head_dim]."""
    from types import SimpleNamespace

    from transformers.models.olmoe.modeling_olmoe import OlmoeRMSNorm

    from autotuner.model.layer_parts import ProjectionKNorm, ProjectionQNorm

    config = SimpleNamespace(num_attention_heads=4, num_query_groups=2)
    generator = torch.Generator().manual_seed(3)
    for norm_class, heads in ((ProjectionQNorm, 4), (ProjectionKNorm, 2)):
        ours, theirs = norm_class(config, hidden_size=8, eps=1e-5), OlmoeRMSNorm(heads * 8, eps=1e-5)
        weight = torch.randn(heads * 8, generator=generator)
        ours.weight.data.copy_(weight)
        theirs.weight.data.copy_(weight)
        x = torch.randn(5, 2, heads, 8, generator=generator)
        assert torch.allclose(ours(x), theirs(x.flatten(-2)).view_as(x), atol=1e-6)


def _core_attention(hf_fields: dict[str, Any], layer_number: int) -> Any:
    """Megatron's core attention of layer ``layer_number`` of the family's model, as a run builds it."""
    from autotuner.model import cpu_bridges
    from autotuner.model.build import ModelParts, build_model, build_transformer_config
    from autotuner.model.runtime import init_parallel, quiet_megatron_import

    quiet_megatron_import()
    args = map_hf_config(_hf(hf_fields))
    tf = build_transformer_config(args, {}, "fp32", torch.device("cpu"), 1)
    cpu_bridges.apply(torch.device("cpu"))
    init_parallel(torch.device("cpu"))
    model = build_model(args, tf, ModelParts(num_layers=layer_number), torch.device("cpu"), False)
    return model.decoder.layers[layer_number - 1].self_attention.core_attention


GEMMA2_SMALL = {
    "model_type": "gemma2",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "vocab_size": 64,
    "max_position_embeddings": 64,
    "query_pre_attn_scalar": 12,
    "attn_logit_softcapping": 5.0,
    "sliding_window": 4,
    "pad_token_id": None,
    "bos_token_id": None,
    "eos_token_id": None,
}


@pytest.mark.parametrize("layer_number", [1, 2])
def test_gemma2_core_attention_is_transformers(layer_number):
    """Gemma-2's core attention as built (softmax scale from query_pre_attn_scalar, scores capped, a
    sliding window on the first layer, full causal on the second) gives transformers' eager attention of
    the same q, k, v with transformers' own mask of that layer's kind."""
    from megatron.core.transformer.enums import AttnMaskType
    from transformers import masking_utils
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

    module = _core_attention(GEMMA2_SMALL, layer_number)
    s, b, heads, groups, d = 10, 2, 4, 2, 8
    generator = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(s, b, n, d, generator=generator) for n in (heads, groups, groups))
    causal = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1)[None, None]
    ours = module(
        q, k, v, causal, attn_mask_type=AttnMaskType.causal, attention_bias=None, packed_seq_params=None
    )
    sliding = layer_number == 1
    allowed = (
        masking_utils.sliding_window_causal_mask_function(GEMMA2_SMALL["sliding_window"])
        if sliding
        else masking_utils.causal_mask_function
    )
    index = torch.arange(s)
    seen = allowed(torch.tensor(0), torch.tensor(0), index[:, None], index[None, :])
    additive = torch.zeros(s, s).masked_fill(~seen, torch.finfo(torch.float32).min)[None, None]
    attention = type("Attention", (torch.nn.Module,), {})()
    attention.num_key_value_groups, attention.training = heads // groups, False
    theirs, _ = eager_attention_forward(
        attention,
        q.permute(1, 2, 0, 3),
        k.permute(1, 2, 0, 3),
        v.permute(1, 2, 0, 3),
        additive,
        dropout=0.0,
        scaling=GEMMA2_SMALL["query_pre_attn_scalar"] ** -0.5,
        softcap=GEMMA2_SMALL["attn_logit_softcapping"],
    )
    assert torch.allclose(ours, theirs.permute(1, 0, 2, 3).reshape(s, b, heads * d), atol=1e-5)


# --- each MoE family routes as transformers' router does -------------------------------------------------

# Small versions of each MoE family's published config: every routing field as published but the sizes
# (and, where the published expert count makes a small model large, the experts and groups, kept in the
# published proportions: DeepSeek-V3's top-k over 2 experts a group, as its top-8 of 8 groups x 32).
MOE_SMALL = {
    "hidden_size": 32,
    "intermediate_size": 48,
    "moe_intermediate_size": 16,
    "shared_expert_intermediate_size": 24,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "vocab_size": 64,
    "first_k_dense_replace": 0,
    "mlp_only_layers": [],
    "decoder_sparse_step": 1,
    "kv_lora_rank": 16,
    "q_lora_rank": 16,
    "qk_nope_head_dim": 8,
    "qk_rope_head_dim": 4,
    "v_head_dim": 8,
    "pad_token_id": None,
    "bos_token_id": None,
    "eos_token_id": None,
    "torch_dtype": "float32",
}
EXPERTS_SMALL = {
    "deepseek_v3": {"n_routed_experts": 16, "num_experts_per_tok": 4, "n_group": 4, "topk_group": 2},
    # top-(k / groups) of 1 is DeepSeek-V2's rule (a group's best expert); Megatron's sums top-(k / groups)
    "deepseek_v2": {"n_routed_experts": 16, "num_experts_per_tok": 2, "n_group": 4, "topk_group": 2},
}


def _small_moe(model_type: str) -> dict[str, Any]:
    fields = {**cases.load_case(PUBLISHED[model_type]).hf_fields, **MOE_SMALL}
    fields.update(EXPERTS_SMALL.get(model_type, {}))
    experts_field = FAMILIES[model_type].moe.experts
    fields.setdefault(experts_field, 8)
    if fields[experts_field] > 16:
        fields[experts_field] = 16
    known = _class_fields(FAMILIES[model_type]) | set(cases.load_case(PUBLISHED[model_type]).hf_fields)
    return {k: v for k, v in fields.items() if k in known}


def _megatron_router(hf_fields: dict[str, Any]) -> Any:
    from autotuner.model import cpu_bridges
    from autotuner.model.build import ModelParts, build_model, build_transformer_config
    from autotuner.model.runtime import init_parallel, quiet_megatron_import

    quiet_megatron_import()
    args = map_hf_config(_hf(hf_fields))
    tf = build_transformer_config(args, {}, "fp32", torch.device("cpu"), 1)
    cpu_bridges.apply(torch.device("cpu"))
    init_parallel(torch.device("cpu"))
    model = build_model(args, tf, ModelParts(num_layers=1), torch.device("cpu"), False)
    return model.decoder.layers[0].mlp.router


MOE_FAMILIES = sorted(name for name, family in FAMILIES.items() if family.moe is not None)


@pytest.mark.parametrize("model_type", MOE_FAMILIES)
def test_router_routes_as_transformers_router(model_type):
    """Megatron's router, configured by the mapping, picks for every token the experts transformers' router
    of the family picks, with the same weights (DeepSeek-V3: sigmoid scores, the expert bias in the choice
    only, groups, renormalised, scaled; the others' softmax before or after the top-k)."""
    from transformers import AutoModelForCausalLM

    fields = _small_moe(model_type)
    hf_config = _hf(fields)
    hf_model = AutoModelForCausalLM.from_config(hf_config)
    theirs = next(
        m for m in hf_model.model.layers[0].modules() if type(m).__name__.lower().endswith("topkrouter")
    )
    ours = _megatron_router(fields)
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        weight = torch.randn(theirs.weight.shape, generator=generator)
        theirs.weight.copy_(weight)
        ours.weight.copy_(weight)
        if hasattr(theirs, "e_score_correction_bias"):
            bias = torch.rand(theirs.e_score_correction_bias.shape, generator=generator) * 0.3
            theirs.e_score_correction_bias.copy_(bias)
            ours.expert_bias.copy_(bias)
    tokens = torch.randn(12, 1, weight.shape[1], generator=generator)
    theirs.eval()
    _, weights, indices = theirs(tokens.view(12, -1))
    ours.train()
    probs, routing_map = ours(tokens)
    chosen = [set(torch.nonzero(row).flatten().tolist()) for row in routing_map]
    assert chosen == [set(row.tolist()) for row in indices]
    assert torch.allclose(probs.gather(1, indices), weights.float(), atol=1e-6)


# --- what a user sees -----------------------------------------------------------------------------------


def test_the_docs_table_is_the_registrys():
    from autotuner.model.families import markdown_table

    text = (REPO / "docs" / "model_families.md").read_text()
    start = text.index("<!-- generated by autotuner.model.families.markdown_table")
    table = text[text.index("\n", start) + 1 : text.index("<!-- end of the generated table -->")].strip()
    assert table == markdown_table()


def test_dry_run_prints_deepseek_v3_as_transformers_counts_it_with_its_notes(capsys):
    """DeepSeek-V3 is an MoE model of 671 B parameters: dry_run prints transformers' own count of it (on
    the meta device), the active count, and the notes of what the run does not express."""
    from autotuner.main import run

    hf_config = _hf(cases.load_case("deepseek_v3").hf_fields)
    total, active, _ = _hf_counts(_hf_model(hf_config), hf_config)
    assert run(["case=deepseek_v3", "dry_run=true", "ops=[router]"]) == 0
    out = capsys.readouterr().out
    assert f"parameters: total {total}, active {active}" in out
    notes = [line for line in out.splitlines() if line.startswith("note: ")]
    assert any("num_nextn_predict_layers=1" in n for n in notes)
    assert any("quantization_config (fp8)" in n for n in notes)


@pytest.mark.slow
def test_a_runs_notes_are_printed_at_start_and_kept_in_environment_json(tmp_path, capsys):
    """A note (here: a key no family table knows) reaches the run's stderr before the first row and its
    environment.json."""
    from autotuner.main import run

    config = {**cases.load_case("tiny").hf_fields, "my_training_flag": 3}
    (tmp_path / "cases" / "mini").mkdir(parents=True)
    (tmp_path / "cases" / "mini" / "config.json").write_text(json.dumps(config))
    (tmp_path / "cases" / "mini.yaml").write_text(
        "hf_config_dir: mini\nshapes: {seq_len: [16], micro_batch_size: [1]}\n"
    )
    run_dir = tmp_path / "run"
    args = [
        f"case_dir={tmp_path / 'cases'}",
        "case=mini",
        "ops=[input_layernorm]",
        f"hydra.run.dir={run_dir}",
    ]
    assert run([*args, "launcher=get_data", "progress=false"]) == 0
    err = capsys.readouterr().err
    assert "note: config key(s) my_training_flag: not fields of transformers' LlamaConfig" in err
    notes = json.loads((run_dir / "environment.json").read_text())["notes"]
    assert any("my_training_flag" in note for note in notes)


def _small_case(tmp_path: Path, model_type: str) -> str:
    """A case folder holding the family's published config at a CPU test's sizes (every other field as
    published); returns case_dir."""
    fields = {**cases.load_case(PUBLISHED[model_type]).hf_fields, **MOE_SMALL, "max_position_embeddings": 64}
    family = FAMILIES[model_type]
    if family.moe is not None:
        fields = {**fields, **_small_moe(model_type)}
    if "sliding_window" in fields and fields["sliding_window"]:
        fields["sliding_window"] = 8
    if model_type == "gemma2":
        fields["query_pre_attn_scalar"] = 8
    known = _class_fields(family) | set(cases.load_case(PUBLISHED[model_type]).hf_fields)
    fields = {k: v for k, v in fields.items() if k in known}
    folder = tmp_path / "cases"
    (folder / "small").mkdir(parents=True)
    (folder / "small" / "config.json").write_text(json.dumps(fields))
    (folder / "small.yaml").write_text(
        "hf_config_dir: small\nshapes: {seq_len: [16], micro_batch_size: [2]}\n"
    )
    return str(folder)


@pytest.mark.slow
@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_every_op_of_every_family_runs_forward_and_backward_on_meta(tmp_path, model_type):
    """Each family's model, as built with its pieces, runs every op it has forward and backward (on meta
    tensors, as dry_run costs them): no op of the family is left unbuildable."""
    from autotuner.config import compose_config
    from autotuner.runner.dry_run import preview
    from autotuner.runner.spec import resolve_spec

    spec = resolve_spec(compose_config([f"case_dir={_small_case(tmp_path, model_type)}", "case=small"]))
    costs = preview(spec).costs
    failed = [(c.op, c.phase, c.error) for c in costs if c.error is not None]
    assert not failed
    ran = {c.op for c in costs}
    assert {"transformer_layer", "core_attention", "output_layer"} <= ran
    if FAMILIES[model_type].post_norms:
        assert {"post_attention_layernorm", "post_mlp_layernorm"} <= ran
    if FAMILIES[model_type].moe is not None:
        assert {"router", "experts", "moe_layer"} <= ran


def test_a_deeper_moe_model_after_a_shallower_one_routes_in_the_same_process():
    """Megatron records each layer's auxiliary loss in a process-wide table sized by the first model that
    routed: a deeper model built later (an op's own parts, another case) indexed past its end."""
    from autotuner.model import cpu_bridges
    from autotuner.model.build import ModelParts, build_model, build_transformer_config
    from autotuner.model.runtime import init_parallel

    fields = _small_moe("mixtral")
    args = map_hf_config(_hf(fields))
    tf = build_transformer_config(args, {}, "fp32", torch.device("cpu"), 1)
    cpu_bridges.apply(torch.device("cpu"))
    init_parallel(torch.device("cpu"))
    tokens = torch.randn(6, 1, fields["hidden_size"])
    for depth in (1, 2):
        model = build_model(args, tf, ModelParts(num_layers=depth), torch.device("cpu"), False)
        router = model.decoder.layers[depth - 1].mlp.router
        router.train()
        probs, _ = router(tokens)
        assert probs.shape == (6, fields["num_local_experts"])
