"""MoE and MLA cases: the published parameter counts, the HF -> Megatron-Core mapping of their fields, a
user's own MoE case, and bad MoE inputs. The counts are those of the Megatron model a run builds (on the
meta device, autotuner.runner.dry_run.model_parameters), compared with the published figures (and with
transformers' own model of each case in tests/test_families.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from autotuner.config import compose_config
from autotuner.errors import UserError
from autotuner.main import run
from autotuner.model import cases
from autotuner.model.hf_to_megatron import map_hf_config
from autotuner.runner.dry_run import model_parameters
from autotuner.runner.spec import resolve_spec

# Published figures as published (billions, one decimal), and where each comes from. The total
# counts every tensor; the active count is what one token's forward pass uses with the embedding and
# output matrices whole, except DeepSeek's, which leaves out the input embedding (see its case notes).
PUBLISHED = {
    "mixtral_8x7b": (46.7, 12.9, "Mistral AI's Mixtral-8x7B announcement"),
    "qwen3_30b_a3b": (30.5, 3.3, "the Qwen3-30B-A3B model card"),
    "deepseek_v2_lite": (15.7, 2.4, "the DeepSeek-V2-Lite model card (active: without the embedding)"),
}


def _hf(name: str, **overrides):
    return cases.build_hf_config(cases.load_case(name).hf_fields, overrides)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_moe_case_builds_at_its_published_size(name: str):
    total, active = model_parameters(resolve_spec(compose_config([f"case={name}"])))
    hf = _hf(name)  # transformers' own model of the case counts the same: tests/test_families.py
    published_total, published_active, source = PUBLISHED[name]
    if name == "deepseek_v2_lite":
        active -= hf.vocab_size * hf.hidden_size  # the published figure leaves out the input embedding
    # One decimal of billions, rounded by some publishers (Mixtral's 12.88 is "12.9") and truncated by
    # others (Qwen's 3.35 is "3.3", DeepSeek's 2.45 "2.4"): within one unit of that decimal.
    assert abs(total / 1e9 - published_total) < 0.1, source
    assert abs(active / 1e9 - published_active) < 0.1, source


def test_every_new_case_is_shipped():
    assert set(PUBLISHED) | {"tiny_moe", "tiny_mla"} <= set(cases.available_cases())


def test_mixtral_fields_map():
    args = map_hf_config(_hf("mixtral_8x7b"))
    tf = args.transformer
    assert (tf["num_moe_experts"], tf["moe_router_topk"], tf["moe_ffn_hidden_size"]) == (8, 2, 14336)
    assert tf["moe_layer_freq"] == 1 and tf["moe_router_pre_softmax"] is False
    assert tf["moe_aux_loss_coeff"] == 0.02 and "moe_shared_expert_intermediate_size" not in tf
    assert tf["num_query_groups"] == 8 and args.rotary_base == 1e6


def test_qwen3_moe_fields_map():
    tf = map_hf_config(_hf("qwen3_30b_a3b")).transformer
    assert (tf["num_moe_experts"], tf["moe_router_topk"], tf["moe_ffn_hidden_size"]) == (128, 8, 768)
    assert tf["qk_layernorm"] is True and tf["moe_router_pre_softmax"] is False  # norm_topk_prob
    tf = map_hf_config(_hf("qwen3_30b_a3b", norm_topk_prob=False)).transformer
    assert tf["moe_router_pre_softmax"] is True


def test_deepseek_v2_lite_fields_map():
    tf = map_hf_config(_hf("deepseek_v2_lite")).transformer
    assert tf["moe_layer_freq"] == [0] + [1] * 26  # first_k_dense_replace=1
    assert tf["moe_shared_expert_intermediate_size"] == 2 * 1408
    assert (tf["ffn_hidden_size"], tf["moe_ffn_hidden_size"], tf["moe_router_topk"]) == (10944, 1408, 6)
    assert tf["multi_latent_attention"] and tf["q_lora_rank"] is None and tf["kv_lora_rank"] == 512
    assert (tf["qk_head_dim"], tf["qk_pos_emb_head_dim"], tf["v_head_dim"]) == (128, 64, 128)
    assert tf["rope_type"] == "yarn" and tf["rotary_scaling_factor"] == 40 and tf["mscale_all_dim"] == 0.707
    assert tf["moe_router_pre_softmax"] is True  # softmax over all 64, top-6 not renormalised


def test_a_users_moe_case_from_its_config_json(tmp_path: Path, capsys):
    """A user's MoE model in its own folder (config.json as HF writes it: Qwen2-MoE's field names, a
    shared expert with its gate, every second layer sparse) runs a dry run with the expected counts."""
    model = tmp_path / "my_moe"
    model.mkdir()
    config = {
        "model_type": "qwen2_moe",
        "hidden_size": 64,
        "intermediate_size": 96,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 48,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_experts": 6,
        "num_experts_per_tok": 2,
        "decoder_sparse_step": 2,
        "norm_topk_prob": False,
        "vocab_size": 512,
        "max_position_embeddings": 128,
        "tie_word_embeddings": False,
    }
    (model / "config.json").write_text(json.dumps(config))
    (tmp_path / "my_moe.yaml").write_text(
        "hf_config_dir: my_moe\nshapes: {seq_len: [16], micro_batch_size: [1]}\n"
    )
    tf = map_hf_config(
        cases.build_hf_config(cases.load_case("my_moe", str(tmp_path)).hf_fields, {})
    ).transformer
    assert tf["moe_layer_freq"] == [0, 1, 0, 1]  # (i + 1) % decoder_sparse_step == 0
    assert tf["moe_shared_expert_intermediate_size"] == 48 and tf["moe_shared_expert_gate"] is True
    assert run(["case=my_moe", f"case_dir={tmp_path}", "dry_run=true"]) == 0
    out = capsys.readouterr().out
    h, d = 64, 16
    attention = h * 4 * d + 2 * h * 2 * d + 4 * d * h + (4 + 2 * 2) * d  # q/k/v biases (Qwen2)
    dense = attention + 2 * h + 3 * h * 96
    moe_common = attention + 2 * h + h * 6 + 3 * h * 48 + h  # router, shared expert, its gate
    total = 2 * 512 * h + h + 2 * dense + 2 * (moe_common + 6 * 3 * h * 32)
    active = 2 * 512 * h + h + 2 * dense + 2 * (moe_common + 2 * 3 * h * 32)
    assert f"parameters: total {total}, active {active}" in out


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["hf.num_experts_per_tok=9"], "num_experts_per_tok (9) exceeds the 8 experts"),
        (["hf.num_local_experts=0"], "num_local_experts=0 must be a positive integer"),
        (["tf.expert_model_parallel_size=3"], "expert_model_parallel_size=3 does not divide the 8 experts"),
    ],
)
def test_bad_moe_input_is_one_line_and_exit_2(overrides, message, capsys, tmp_path: Path):
    assert run(["case=tiny_moe", f"hydra.run.dir={tmp_path / 'run'}", *overrides]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "run").exists()


def test_first_k_dense_beyond_the_layers_is_refused():
    with pytest.raises(UserError, match=r"first_k_dense_replace=2 must be an integer in \[0, 2\)"):
        map_hf_config(_hf("tiny_mla", first_k_dense_replace=2))
