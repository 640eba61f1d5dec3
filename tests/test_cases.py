"""Cases and the HF -> Megatron-Core mapping: published parameter counts, user cases, bad case files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from autotuner.errors import UserError
from autotuner.model import cases
from autotuner.model.counts import count_parameters
from autotuner.model.hf_to_megatron import map_hf_config

# Totals published with each model's weights (the sum of the safetensors' tensor sizes).
PUBLISHED_PARAMETERS = {
    "llama7b": 6_738_415_616,
    "llama13b": 13_015_864_320,
    "llama70b": 68_976_648_192,
    "llama3_8b": 8_030_261_248,
    "mistral7b": 7_241_732_096,
    "llama3_1_8b": 8_030_261_248,
    "qwen2_5_7b": 7_615_616_512,  # model.safetensors.index.json's total_size / 2 (bf16)
}


@pytest.fixture(scope="module")
def transformer_config_of():
    from autotuner.model.build import build_transformer_config
    from autotuner.model.runtime import quiet_megatron_import

    quiet_megatron_import()
    import torch

    def build(name: str, **hf_overrides):
        case = cases.load_case(name)
        args = map_hf_config(cases.build_hf_config(case.hf_fields, hf_overrides))
        return args, build_transformer_config(args, {}, "fp32", torch.device("cpu"), 1)

    return build


def test_every_published_case_is_shipped():
    moe = {"mixtral_8x7b", "qwen3_30b_a3b", "deepseek_v2_lite", "tiny_moe", "tiny_mla"}  # test_moe_cases
    assert set(PUBLISHED_PARAMETERS) | {"tiny"} | moe <= set(cases.available_cases())


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMETERS))
def test_full_model_parameter_count_matches_published_total(name, transformer_config_of):
    args, tf = transformer_config_of(name)
    assert count_parameters(args, tf).total == PUBLISHED_PARAMETERS[name]


def test_llama7b_layer_and_mapping(transformer_config_of):
    args, tf = transformer_config_of("llama7b")
    assert count_parameters(args, tf).layer(False).parameters == 202_383_360
    assert (tf.num_query_groups, tf.kv_channels, tf.ffn_hidden_size) == (32, 128, 11008)
    assert tf.normalization == "RMSNorm" and tf.gated_linear_unit and not tf.add_bias_linear
    assert tf.activation_func.__name__ == "silu" and args.rotary_base == 10000.0
    assert args.tie_word_embeddings is False and args.vocab_size == 32000


def test_gqa_and_rope_theta_map(transformer_config_of):
    args, tf = transformer_config_of("llama3_8b")
    assert tf.num_attention_heads == 32 and tf.num_query_groups == 8
    assert args.rotary_base == 500000.0 and args.vocab_size == 128256


def test_an_enum_field_is_set_by_its_member_name(transformer_config_of):
    """``tf.attention_backend=local`` (a name, as Megatron's own arguments take it) becomes the member."""
    import torch
    from megatron.core.transformer.enums import AttnBackend

    from autotuner.model.build import build_transformer_config

    args, _ = transformer_config_of("tiny")
    tf = build_transformer_config(args, {"attention_backend": "local"}, "fp32", torch.device("cpu"), 1)
    assert tf.attention_backend is AttnBackend.local


def test_hf_overrides_apply_before_mapping(transformer_config_of):
    args, tf = transformer_config_of("tiny", hidden_size=128, head_dim=32, num_key_value_heads=4)
    assert tf.hidden_size == 128 and tf.kv_channels == 32 and tf.num_query_groups == 4


def test_sliding_window_is_megatrons_window():
    """Mistral's sliding window is Megatron's window_size, counting the token itself as HF's does (its
    attention is checked against transformers' in tests/test_families.py)."""
    case = cases.load_case("mistral7b")
    args = map_hf_config(cases.build_hf_config(case.hf_fields, {}))
    assert args.transformer["window_size"] == (4095, 0) and not args.notes


def test_unknown_hf_field_is_an_error():
    case = cases.load_case("tiny")
    with pytest.raises(UserError, match="hiden_size"):
        cases.build_hf_config(case.hf_fields, {"hiden_size": 3})


def test_llama_attention_bias_without_mlp_bias_is_refused():
    case = cases.load_case("tiny")
    with pytest.raises(UserError, match="attention_bias"):
        map_hf_config(cases.build_hf_config(case.hf_fields, {"attention_bias": True}))


def test_user_case_dir_and_config_json_folder(tmp_path: Path):
    model_dir = tmp_path / "my_model"
    model_dir.mkdir()
    tiny = cases.load_case("tiny").hf_fields
    (model_dir / "config.json").write_text(json.dumps({**tiny, "hidden_size": 96, "head_dim": 24}))
    (tmp_path / "mymodel.yaml").write_text(
        "hf_config_dir: my_model\nshapes: {seq_len: [8], micro_batch_size: [1]}\n"
    )
    (tmp_path / "folder.yaml").mkdir()  # not a case file, so not offered as one
    assert "mymodel" in cases.available_cases(str(tmp_path))
    assert "folder" not in cases.available_cases(str(tmp_path))
    case = cases.load_case("mymodel", str(tmp_path))
    assert case.hf_fields["hidden_size"] == 96 and case.shapes["seq_len"] == [8]
    # built-in cases stay reachable beside the user's
    assert cases.load_case("tiny", str(tmp_path)).hf_fields["hidden_size"] == 64


@pytest.mark.parametrize(
    "text, message",
    [
        ("hf_config: {model_type: llama}\nhf_config_dir: x\n", "exactly one of"),
        ("shapes: {seq_len: [8]}\n", "exactly one of"),
        ("hf_config: {model_type: llama}\nshape: {}\n", "unknown key"),
        ("hf_config_dir: nowhere\n", "config.json"),
        ("[unclosed", "not valid YAML"),
        (b"hf_config: {model_type: \xff}\n", "not UTF-8 text"),
    ],
)
def test_bad_case_files(tmp_path: Path, text: str | bytes, message: str):
    bad = tmp_path / "bad.yaml"
    bad.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(UserError, match=message):
        cases.load_case("bad", str(tmp_path))


def test_unknown_case_lists_the_known_ones():
    with pytest.raises(UserError, match="llama7b"):
        cases.load_case("llama8")
