"""The dummy-weight model configs in data/models/ load the way SGLang 0.5.17 loads them, and
have the Kimi K2 shapes they claim."""
from __future__ import annotations

import json

import pytest

from sm120_workbook import dummy_models as dm


@pytest.fixture(scope="module")
def sglang_config():
    from sglang.srt.utils.hf_transformers_utils import get_config

    return lambda path: get_config(str(path), trust_remote_code=False)


K2_ATTENTION = {"kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128,
                "q_lora_rank": 1536, "hidden_size": 7168, "vocab_size": 163840}
K2_MOE = {"n_routed_experts": 384, "num_experts_per_tok": 8, "n_shared_experts": 1, "n_group": 1,
          "topk_group": 1, "topk_method": "noaux_tc", "scoring_func": "sigmoid", "first_k_dense_replace": 1,
          "moe_layer_freq": 1, "routed_scaling_factor": 2.827}


@pytest.mark.parametrize("name,heads,moe_width,dense_width", [
    ("k2_tp8_slice", 8, 256, 2304), ("kimi_k2", 64, 2048, 18432)])
def test_model_configs_load_as_sglang_does(name, heads, moe_width, dense_width, tmp_path, sglang_config):
    path = dm.materialize_model(name, 3, dest=tmp_path / name)
    cfg = sglang_config(path)
    assert type(cfg).__name__ == "DeepseekV3Config" and cfg.architectures == ["DeepseekV3ForCausalLM"]
    assert cfg.num_hidden_layers == 3 and cfg.num_attention_heads == heads
    assert cfg.moe_intermediate_size == moe_width and cfg.intermediate_size == dense_width
    for k, v in {**K2_ATTENTION, **K2_MOE}.items():
        assert getattr(cfg, k) == v, k
    # transformers 5 folds rope_scaling into rope_parameters, which deepseek_v2.py reads
    assert cfg.rope_parameters["rope_type"] == "yarn" and cfg.rope_parameters["rope_theta"] == 50000.0
    assert cfg.rope_parameters["factor"] == 64.0 and cfg.max_position_embeddings >= 131072 + 4096


@pytest.mark.parametrize("name,quant", [("k2_tp8_slice", None), ("kimi_k2", "fp8")])
def test_sglang_model_config_sees_mla_and_context(name, quant, tmp_path):
    from sglang.srt.configs.model_config import AttentionArch, ModelConfig
    from sglang.srt.utils.hf_transformers.common import get_context_length

    path = dm.materialize_model(name, 2, dest=tmp_path / name)
    mc = ModelConfig(str(path), context_length=131072 + 1024)
    assert mc.attention_arch == AttentionArch.MLA and mc.context_len == 131072 + 1024
    assert mc.kv_lora_rank == 512 and mc.qk_rope_head_dim == 64
    assert mc.quantization == quant
    raw = json.loads((path / "config.json").read_text())
    assert dm.max_context(raw) == get_context_length(mc.hf_text_config) == 262144


def test_weight_format_switch(tmp_path):
    assert "quantization_config" not in dm.model_config("kimi_k2", 4, weights="bf16")
    assert dm.model_config("k2_tp8_slice", 4, weights="fp8")["quantization_config"]["weight_block_size"] == [128, 128]
    assert dm.weight_format(dm.model_config("kimi_k2")) == "fp8"
    assert dm.weight_format(dm.model_config("k2_tp8_slice")) == "bf16"
    with pytest.raises(ValueError, match="weights"):
        dm.model_config("kimi_k2", 4, weights="int4")
    with pytest.raises(ValueError, match="layers: 1 leaves no MoE layer"):
        dm.model_config("kimi_k2", 1)
    with pytest.raises(ValueError, match="name"):
        dm.model_config("llama", 4)


@pytest.mark.parametrize("layers,expected_ids", [(3, [1, 2]), (4, [1, 2]), (61, None)])
def test_dflash_draft_matches_target_and_sglang_accepts_it(layers, expected_ids, tmp_path, sglang_config):
    from sglang.srt.speculative.dflash_utils import build_target_layer_ids, parse_dflash_draft_config

    target = dm.materialize_model("k2_tp8_slice", layers, dest=tmp_path / "target")
    draft = dm.materialize_draft(target, block_size=16, dest=tmp_path / "draft")
    cfg = sglang_config(draft)
    assert type(cfg).__name__ == "Qwen3Config" and cfg.architectures == ["DFlashDraftModel"]
    assert cfg.hidden_size == 7168 and cfg.vocab_size == 163840
    parsed = parse_dflash_draft_config(draft_hf_config=cfg)
    assert parsed.num_target_layers == layers and parsed.block_size == 16
    ids = parsed.resolve_target_layer_ids(target_num_layers=layers, draft_num_layers=cfg.num_hidden_layers)
    assert ids == (expected_ids or build_target_layer_ids(layers, 2))
    assert len(set(ids)) == len(ids) and all(0 <= i < layers for i in ids)
    assert 0 <= cfg.dflash_config["mask_token_id"] < cfg.vocab_size


def test_target_layer_rule_replica_matches_sglang():
    from sglang.srt.speculative.dflash_utils import build_target_layer_ids

    for n in range(4, 70):
        for k in (1, 2, 3, 5):
            assert dm._build_target_layer_ids(n, k) == build_target_layer_ids(n, k)


def test_layer_memory_and_fit():
    slice_cfg = dm.model_config("k2_tp8_slice")
    k2 = dm.model_config("kimi_k2")
    # One TP8 rank of K2 holds what the slice holds at TP1, expert for expert (bf16 both).
    k2_bf16 = dm.model_config("kimi_k2", weights="bf16")
    assert dm.layer_weight_bytes(k2_bf16, 8) == pytest.approx(dm.layer_weight_bytes(slice_cfg, 1))
    assert dm.layer_weight_bytes(slice_cfg, 1) / 2**30 == pytest.approx(4.0, abs=0.1)
    assert dm.layer_weight_bytes(k2, 1) / 2**30 == pytest.approx(15.8, abs=0.3)  # fp8
    assert dm.kv_bytes_per_token_layer(slice_cfg) == 1152
    h200 = 139 * 2**30
    n = dm.fit_layers("k2_tp8_slice", 1, h200, 0.8, kv_tokens=132000)
    assert 15 <= n <= 30
    assert dm.fit_layers("k2_tp8_slice", 1, 2 * h200, 0.8, kv_tokens=132000) > n
    assert dm.fit_layers("kimi_k2", 8, h200, 0.85, kv_tokens=132000) >= 40
    with pytest.raises(ValueError, match="does not fit"):
        dm.fit_layers("kimi_k2", 1, 24 * 2**30, 0.8)
    with pytest.raises(ValueError, match="tp: 3 does not divide"):
        dm.heads_per_rank(slice_cfg, 3)


def test_an_mtp_layer_makes_sglangs_eagle_draft_the_nextn_model(tmp_path):
    """mtp_layers=1: SGLang reads the folder as its own EAGLE draft, DeepSeek-V3's NextN layer
    (ModelConfig with is_draft_model), with one MTP layer; the base config keeps K2's none."""
    from sglang.srt.configs.model_config import ModelConfig

    assert dm.model_config("k2_tp8_slice", 3)["num_nextn_predict_layers"] == 0
    path = dm.materialize_model("k2_tp8_slice", 3, dest=tmp_path / "mtp", mtp_layers=1)
    draft = ModelConfig(str(path), is_draft_model=True)
    assert draft.hf_config.architectures == ["DeepseekV3ForCausalLMNextN"]
    assert draft.num_nextn_predict_layers == 1
    for bad in (-1, True, 1.0):
        with pytest.raises(ValueError, match="^mtp_layers: must be an int >= 0"):
            dm.model_config("k2_tp8_slice", 3, mtp_layers=bad)


@pytest.mark.parametrize("name,heads,weights", [("k2_tp8_slice", 8, "bf16"), ("kimi_k2", 64, "fp8")])
def test_eagle3_mla_draft_is_an_mla_draft_for_sglang(name, heads, weights, tmp_path, sglang_config):
    """The EAGLE3-MLA draft: SGLang reads it as an MLA model (so an MLA backend, the kernel, serves
    its attention), with the target's attention shape, one bf16 layer, three aux hidden states into
    fc and the target's LM head."""
    from sglang.srt.configs.model_config import AttentionArch, ModelConfig
    from sglang.srt.models.kimi_k25_eagle3 import _get_eagle_aux_layer_count

    target = dm.materialize_model(name, 16, dest=tmp_path / "target", weights=weights)
    draft = dm.materialize_eagle3_draft(target, dest=tmp_path / "draft")
    cfg = sglang_config(draft)
    assert cfg.architectures == [dm.EAGLE3_MLA_ARCH] and cfg.num_hidden_layers == 1
    assert cfg.num_attention_heads == heads and not getattr(cfg, "tie_word_embeddings", False)
    for k, v in K2_ATTENTION.items():
        assert getattr(cfg, k) == v, k
    assert getattr(cfg, "draft_vocab_size", None) is None   # the head is the target's
    assert _get_eagle_aux_layer_count(cfg) == 3
    mc = ModelConfig(str(draft), is_draft_model=True)
    assert mc.attention_arch == AttentionArch.MLA and mc.quantization is None
    assert mc.hf_config.architectures == [dm.EAGLE3_MLA_ARCH]
    assert json.loads((target / "config.json").read_text())["num_hidden_layers"] == 16
    with pytest.raises(ValueError, match="^target_cfg: an EAGLE3-MLA draft"):
        dm.eagle3_draft_config({"hidden_size": 4096})


@pytest.mark.parametrize("name,heads,dense_width", [("k2_tp8_slice", 8, 2304), ("kimi_k2", 64, 18432)])
def test_eagle3_llama_draft_is_an_mha_draft_for_sglang(name, heads, dense_width, tmp_path, sglang_config):
    """The EAGLE3 Llama head (SpecForge's Kimi K2 layout): SGLang reads it as an MHA model (so
    the kernel, MLA only, does not serve it), with 128-dim heads, as many KV heads as query heads,
    the target's dense width, three aux hidden states into fc, the target's LM head and the
    target's context."""
    from sglang.srt.configs.model_config import AttentionArch, ModelConfig

    target = dm.materialize_model(name, 16, dest=tmp_path / "target", weights="fp8" if name == "kimi_k2" else "bf16")
    draft = dm.materialize_eagle3_draft(target, dest=tmp_path / "draft", head="llama")
    cfg = sglang_config(draft)
    assert cfg.architectures == [dm.EAGLE3_LLAMA_ARCH] and cfg.num_hidden_layers == 1
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (heads, heads, 128)
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size) == (7168, dense_width, 163840)
    # set, to null: SGLang's LlamaForCausalLMEagle3.__init__ reads config.draft_vocab_size (absent,
    # the H200's first server stopped at model init, session 36); None takes the target's LM head
    assert cfg.draft_vocab_size is None and not cfg.tie_word_embeddings
    mc = ModelConfig(str(draft), is_draft_model=True)
    assert mc.attention_arch == AttentionArch.MHA and mc.quantization is None
    assert (mc.num_key_value_heads, mc.head_dim) == (heads, 128)
    assert mc.context_len == dm.max_context(json.loads((target / "config.json").read_text()))
    with pytest.raises(ValueError, match="^head: one of"):
        dm.materialize_eagle3_draft(target, dest=tmp_path / "x", head="mha")
    with pytest.raises(ValueError, match="^layers: an EAGLE3 head"):
        dm.eagle3_llama_draft_config(dm.model_config("k2_tp8_slice", 5))


def test_eagle3_aux_layers_are_sglangs_and_must_differ():
    """The layers an EAGLE3 head reads by default are SGLang's own choice, which captures each
    distinct layer once: a target where two coincide (4-6 layers) is refused, naming the layers."""
    from types import SimpleNamespace

    from sglang.srt.models.deepseek_v2 import DeepseekV2ForCausalLM

    for n in (3, 7, 16, 61):
        fake = SimpleNamespace(pp_group=SimpleNamespace(is_last_rank=True),
                               config=SimpleNamespace(num_hidden_layers=n), model=SimpleNamespace())
        DeepseekV2ForCausalLM.set_eagle3_layers_to_capture(fake, None)
        assert dm.eagle3_aux_layers(n) == fake.model.layers_to_capture
    for n in (1, 2, 4, 5, 6):
        with pytest.raises(ValueError, match=rf"^layers: an EAGLE3 head reads target layers .* L = {n} gives"):
            dm.eagle3_aux_layers(n)
    with pytest.raises(ValueError, match="^layers: an EAGLE3 head"):
        dm.eagle3_draft_config(dm.model_config("k2_tp8_slice", 4))
