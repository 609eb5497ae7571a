"""Dummy-weight model folders for SGLang: a config.json and nothing else.

SGLang 0.5.17 serves a folder holding only a config.json with `--load-format dummy
--skip-tokenizer-init` (weights are random, requests carry token ids). The base configs live
in data/models/ (see data/models/README.md):

- `k2_tp8_slice`: one GPU's share of Kimi K2 at TP8: 8 of 64 MLA heads, expert FFN width
  2048/8 = 256 and dense FFN width 18432/8 = 2304 (SGLang's TP MoE shards every expert by its
  intermediate dimension), all 384 routed experts top-8 plus 1 shared expert, bf16.
- `kimi_k2`: the whole K2 shape (64 heads, expert width 2048, 61 layers) with K2's own fp8
  block-quantization config, for TP8 across eight GPUs.
- `dflash_draft`: a DFlash draft (qwen3 layers, `DFlashDraftModel`); its `dflash_config`
  must name the target's layer count, so `materialize_draft` writes one per target.

An EAGLE3 draft head is derived from the target's own config by `materialize_eagle3_draft`, of
either layout SGLang serves for these targets (no base file: every shape is the target's):
- `mla`: SGLang's `Eagle3DeepseekV2ForCausalLM`, the layout of the Kimi K2.5/K2.6 EAGLE3-MLA
  heads; its draft attention is MLA, so it runs on sm120_mla's kernel;
- `llama`: `LlamaForCausalLMEagle3` with MHA attention, the layout of SpecForge's Kimi K2
  heads (configs/kimi-k2-eagle3.json); its draft attention is not MLA, so it keeps SGLang's
  own MHA backends.

A folder is materialised with the layer count chosen (records carry `layers` so that per-layer
figures scale to K2's 61).
"""
from __future__ import annotations

import copy
import json
import tempfile
from pathlib import Path

from . import project_root

MODEL_NAMES = ("k2_tp8_slice", "kimi_k2")
DRAFT_NAME = "dflash_draft"
# SGLang 0.5.17's EAGLE3 draft with DeepSeek-V2 MLA attention (models/kimi_k25_eagle3.py).
EAGLE3_MLA_ARCH = "Eagle3DeepseekV2ForCausalLM"
# ... and its Llama one (models/llama_eagle3.py), MHA attention.
EAGLE3_LLAMA_ARCH = "LlamaForCausalLMEagle3"
# An EAGLE3 head's layout (materialize_eagle3_draft's `head`) and its architecture.
EAGLE3_HEADS = {"mla": EAGLE3_MLA_ARCH, "llama": EAGLE3_LLAMA_ARCH}
# SpecForge's Kimi K2 EAGLE3 head: 128-dim MHA heads, as many as the target's (64, 8 a rank at TP8).
EAGLE3_LLAMA_HEAD_DIM = 128
K2_LAYERS = 61
# K2's own checkpoint quantization (fp8 e4m3, 128x128 weight blocks): with it SGLang creates
# fp8 parameters directly and the dummy loader fills them through an fp16 temporary.
FP8_QUANTIZATION_CONFIG = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": [128, 128],
}
# MLA caches one latent (kv_lora_rank) plus the rope key per token and layer, shared by heads.
KV_CACHE_BYTES_PER_ELEMENT = 2  # bf16 KV cache (--kv-cache-dtype auto)


def models_dir() -> Path:
    return project_root() / "data" / "models"


def load_config(name: str) -> dict:
    """The base config.json of data/models/<name> as a dict."""
    path = models_dir() / name / "config.json"
    if not path.is_file():
        known = sorted(p.parent.name for p in models_dir().glob("*/config.json"))
        raise ValueError(f"name: no model config {path} (known: {known})")
    return json.loads(path.read_text())


def model_config(name: str, layers: int | None = None, weights: str = "auto",
                 mtp_layers: int | None = None) -> dict:
    """The config of model `name` with `layers` hidden layers and the chosen weight format.

    weights: "auto" (as in the base config), "bf16" (drop any quantization_config) or "fp8"
    (K2's block fp8 quantization_config). mtp_layers: num_nextn_predict_layers, the MTP
    layers SGLang's EAGLE drafts with (DeepSeek-V3 has 1; K2's checkpoints have none, so its
    base config says 0); None keeps the base config's.
    """
    if name not in MODEL_NAMES:
        raise ValueError(f"name: {name!r} is not one of {MODEL_NAMES}")
    cfg = copy.deepcopy(load_config(name))
    if layers is not None:
        if not isinstance(layers, int) or layers < 1:
            raise ValueError(f"layers: must be a positive int, got {layers!r}")
        if layers <= cfg.get("first_k_dense_replace", 0):
            raise ValueError(
                f"layers: {layers} leaves no MoE layer (first_k_dense_replace="
                f"{cfg['first_k_dense_replace']}); use at least {cfg['first_k_dense_replace'] + 1}")
        cfg["num_hidden_layers"] = layers
    if mtp_layers is not None:
        if isinstance(mtp_layers, bool) or not isinstance(mtp_layers, int) or mtp_layers < 0:
            raise ValueError(f"mtp_layers: must be an int >= 0, got {mtp_layers!r}")
        cfg["num_nextn_predict_layers"] = mtp_layers
    if weights == "bf16":
        cfg.pop("quantization_config", None)
    elif weights == "fp8":
        cfg["quantization_config"] = copy.deepcopy(FP8_QUANTIZATION_CONFIG)
    elif weights != "auto":
        raise ValueError(f"weights: must be 'auto', 'bf16' or 'fp8', got {weights!r}")
    return cfg


def weight_format(cfg: dict) -> str:
    q = cfg.get("quantization_config")
    return "bf16" if not q else str(q.get("quant_method", "quantized"))


def _write_config(cfg: dict, dest: str | Path | None, prefix: str) -> Path:
    d = Path(dest) if dest is not None else Path(tempfile.mkdtemp(prefix=prefix))
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return d


def materialize_model(name: str, layers: int | None = None, dest: str | Path | None = None,
                      weights: str = "auto", mtp_layers: int | None = None) -> Path:
    """Write a servable model folder (config.json only) and return its path.

    dest: folder to write (created); default a fresh temporary folder. mtp_layers: as
    `model_config`.
    """
    cfg = model_config(name, layers, weights, mtp_layers)
    return _write_config(cfg, dest, f"sm120_{name}_L{cfg['num_hidden_layers']}_")


def dflash_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """Target layers whose hidden states feed the DFlash draft.

    SGLang's own choice (`build_target_layer_ids` in sglang/srt/speculative/dflash_utils.py)
    for targets of 4+ layers; below that SGLang refuses, so take distinct layers from 1 up
    (the device README's 4-layer run used [1, 2]).
    """
    if num_target_layers < 1 or num_draft_layers < 1:
        raise ValueError("num_target_layers and num_draft_layers must be positive")
    if num_target_layers >= 4:
        try:
            from sglang.srt.speculative.dflash_utils import build_target_layer_ids
        except Exception:  # noqa: BLE001 - SGLang absent or partial: the same rule, replicated
            build_target_layer_ids = _build_target_layer_ids
        ids = [int(i) for i in build_target_layer_ids(num_target_layers, num_draft_layers)]
        if len(set(ids)) == len(ids):
            return ids
    # Short targets: SGLang's rule repeats layers (4 layers, 2 draft layers -> [1, 1]).
    return [min(1 + i, num_target_layers - 1) for i in range(num_draft_layers)]


def _build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    # Replica of sglang/srt/speculative/dflash_utils.py:build_target_layer_ids (0.5.17).
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    span = end - start
    return [int(round(start + (i * span) / (num_draft_layers - 1))) for i in range(num_draft_layers)]


def draft_config(target_cfg: dict, block_size: int = 16, draft_layers: int | None = None) -> dict:
    """The DFlash draft config matched to a target config (hidden size, vocab, layer ids).

    block_size: the verify window (SGLang requires --speculative-num-draft-tokens to equal it).
    """
    if block_size < 2:
        raise ValueError(f"block_size: must be >= 2, got {block_size}")
    cfg = copy.deepcopy(load_config(DRAFT_NAME))
    if draft_layers is not None:
        if draft_layers < 1:
            raise ValueError(f"draft_layers: must be positive, got {draft_layers}")
        cfg["num_hidden_layers"] = draft_layers
    n_target = int(target_cfg["num_hidden_layers"])
    cfg["hidden_size"] = int(target_cfg["hidden_size"])
    cfg["vocab_size"] = int(target_cfg["vocab_size"])
    cfg["max_position_embeddings"] = int(target_cfg["max_position_embeddings"])
    dcfg = cfg["dflash_config"]
    dcfg["block_size"] = int(block_size)
    dcfg["num_target_layers"] = n_target
    dcfg["target_layer_ids"] = dflash_target_layer_ids(n_target, int(cfg["num_hidden_layers"]))
    # With no tokenizer SGLang takes mask_token_id as given; it must be a valid target id.
    if not 0 <= dcfg["mask_token_id"] < cfg["vocab_size"]:
        raise ValueError(f"dflash mask_token_id {dcfg['mask_token_id']} is outside the vocab")
    return cfg


def materialize_draft(target_dir: str | Path, block_size: int = 16, dest: str | Path | None = None,
                      draft_layers: int | None = None) -> Path:
    """Write a DFlash draft folder matched to the target folder `target_dir`."""
    target_cfg = json.loads((Path(target_dir) / "config.json").read_text())
    cfg = draft_config(target_cfg, block_size, draft_layers)
    return _write_config(cfg, dest, f"sm120_dflash_draft_B{block_size}_")


def eagle3_aux_layers(num_target_layers: int) -> list[int]:
    """The target layers whose hidden states an EAGLE3 head with no layer ids of its own reads:
    SGLang 0.5.17's default, [2, L // 2, L - 3] (DeepseekV2ForCausalLM.set_eagle3_layers_to_capture).
    SGLang captures each distinct layer once and expects three (AuxHiddenStatePacker), so the
    three must differ: L = 3 or L >= 7, else an error naming the layer count."""
    ids = [2, num_target_layers // 2, num_target_layers - 3]
    if len(set(ids)) != 3 or min(ids) < 0 or max(ids) >= num_target_layers:
        raise ValueError(f"layers: an EAGLE3 head reads target layers [2, L // 2, L - 3] (SGLang's default), "
                         f"which must be three distinct layers (L = 3 or L >= 7); L = {num_target_layers} "
                         f"gives {ids}")
    return ids


def eagle3_draft_config(target_cfg: dict) -> dict:
    """The EAGLE3-MLA draft config matched to a target config.

    SGLang's `Eagle3DeepseekV2ForCausalLM`: one decoder layer with the target's MLA shape (heads,
    q_lora_rank, kv_lora_rank, rope, yarn), whose fused QKV-down projection reads the token's
    embedding beside the draft's hidden state; a dense FFN of the target's dense width; an `fc`
    over three of the target's hidden states (no layer ids given: SGLang captures layers 2, L/2
    and L - 3, which must differ, `eagle3_aux_layers`, and the draft expects three). bf16 (the
    target's quantization_config is dropped); no `draft_vocab_size`, so the LM head is the target's.
    Its draft attention is MLA, so SGLang serves it with an MLA backend: sm120_mla's kernel, as for
    the MTP layer.
    """
    if not target_cfg.get("kv_lora_rank"):
        raise ValueError("target_cfg: an EAGLE3-MLA draft copies the target's MLA shape; this config "
                         "has no kv_lora_rank")
    eagle3_aux_layers(int(target_cfg["num_hidden_layers"]))
    cfg = copy.deepcopy(target_cfg)
    for key in ("quantization_config", "num_nextn_predict_layers", "eagle_config",
                "eagle_aux_hidden_state_layer_ids", "draft_vocab_size"):
        cfg.pop(key, None)
    cfg["architectures"] = [EAGLE3_MLA_ARCH]
    cfg["num_hidden_layers"] = 1
    cfg["tie_word_embeddings"] = False
    return cfg


def eagle3_llama_draft_config(target_cfg: dict) -> dict:
    """The EAGLE3 Llama draft config matched to a target config: the layout of SpecForge's Kimi K2
    head (configs/kimi-k2-eagle3.json), SGLang's `LlamaForCausalLMEagle3`.

    One Llama decoder layer of the target's hidden size with MHA attention: 128-dim heads, as many
    query and KV heads as the target's attention heads (K2: 64; the TP8 slice: 8), a dense FFN of
    the target's dense width (K2: 18432), an `fc` over three target hidden states (SGLang's
    default layers, as for the MLA head: `eagle3_aux_layers`). bf16. Unlike SpecForge's head,
    `draft_vocab_size` null (SGLang reads the attribute: it must be there): a 32,000-token LM head
    needs its d2t map from the weights, which a dummy load does not give, so the LM head is the
    target's (as the MLA head's). Its draft attention is MHA, which sm120_mla's kernel does not
    serve: the plugin's factory patch leaves non-MLA drafts on SGLang's triton backend, and
    service.resolve_config names FlashInfer's for it under sm120_mla (--speculative-draft-attention-backend).
    """
    eagle3_aux_layers(int(target_cfg["num_hidden_layers"]))
    heads = int(target_cfg["num_attention_heads"])
    return {
        "architectures": [EAGLE3_LLAMA_ARCH], "model_type": "llama", "torch_dtype": "bfloat16",
        "hidden_size": int(target_cfg["hidden_size"]), "intermediate_size": int(target_cfg["intermediate_size"]),
        "num_hidden_layers": 1, "num_attention_heads": heads, "num_key_value_heads": heads,
        "head_dim": EAGLE3_LLAMA_HEAD_DIM, "hidden_act": "silu", "rms_norm_eps": target_cfg.get("rms_norm_eps", 1e-6),
        "rope_theta": 1000000.0, "rope_scaling": None, "max_position_embeddings": max_context(target_cfg),
        # null, not absent: SGLang's head reads config.draft_vocab_size (None: the target's LM head)
        "vocab_size": int(target_cfg["vocab_size"]), "draft_vocab_size": None, "tie_word_embeddings": False,
        "attention_bias": False, "bos_token_id": target_cfg.get("bos_token_id"),
        "eos_token_id": target_cfg.get("eos_token_id"),
    }


def materialize_eagle3_draft(target_dir: str | Path, dest: str | Path | None = None, head: str = "mla") -> Path:
    """Write an EAGLE3 draft folder (config.json only) matched to the target folder `target_dir`:
    `head` "mla" (eagle3_draft_config) or "llama" (eagle3_llama_draft_config)."""
    if head not in EAGLE3_HEADS:
        raise ValueError(f"head: one of {sorted(EAGLE3_HEADS)}, got {head!r}")
    target_cfg = json.loads((Path(target_dir) / "config.json").read_text())
    cfg = eagle3_draft_config(target_cfg) if head == "mla" else eagle3_llama_draft_config(target_cfg)
    return _write_config(cfg, dest, f"sm120_eagle3_{head}_draft_")


def max_context(cfg: dict) -> int:
    """The context length SGLang derives from a config (it refuses longer --context-length).

    Same rule as sglang/srt/utils/hf_transformers/common.py:get_context_length (0.5.17):
    the first of its context keys, times the rope factor unless the yarn config names
    original_max_position_embeddings (K2's does, so the factor is 1).
    """
    rope = cfg.get("rope_scaling") or {}
    factor = rope.get("factor", 1) if rope else 1
    if "original_max_position_embeddings" in rope or rope.get("rope_type") == "llama3":
        factor = 1
    for key in ("max_sequence_length", "seq_length", "max_seq_len", "model_max_length",
                "max_position_embeddings"):
        if cfg.get(key) is not None:
            return int(factor * cfg[key])
    return 2048


def heads_per_rank(cfg: dict, tp: int) -> int:
    heads = int(cfg["num_attention_heads"])
    if tp < 1 or heads % tp:
        raise ValueError(f"tp: {tp} does not divide num_attention_heads={heads}")
    return heads // tp


# ---- memory estimate, to choose a layer count that fits -----------------------------------

def _weight_bytes(cfg: dict) -> float:
    return 1.0 if weight_format(cfg) == "fp8" else 2.0


def layer_weight_bytes(cfg: dict, tp: int, moe: bool = True) -> float:
    """Bytes of one decoder layer's weights on one TP rank (TP MoE: experts sharded by width)."""
    h = cfg["hidden_size"]
    nh = heads_per_rank(cfg, tp)
    q_lora, kv_lora = cfg["q_lora_rank"] or 0, cfg["kv_lora_rank"]
    nope, rope, v = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    attn = (h * q_lora + q_lora * nh * (nope + rope) if q_lora else h * nh * (nope + rope))
    attn += h * (kv_lora + rope) + kv_lora * nh * (nope + v) + nh * v * h
    if moe:
        width = cfg["moe_intermediate_size"] / tp
        ffn = (cfg["n_routed_experts"] + cfg.get("n_shared_experts", 0)) * 3 * h * width
        gate = h * cfg["n_routed_experts"] * 2.0  # router stays in bf16/fp32: count 2 bytes
    else:
        ffn, gate = 3 * h * cfg["intermediate_size"] / tp, 0.0
    return (attn + ffn) * _weight_bytes(cfg) + gate


def embedding_bytes(cfg: dict, tp: int) -> float:
    """Embedding plus LM head (vocab-parallel, bf16)."""
    return 2 * cfg["vocab_size"] / tp * cfg["hidden_size"] * 2.0


def dummy_init_peak_bytes(cfg: dict, tp: int) -> float:
    """Extra bytes while the dummy loader fills fp8 weights (an fp16 copy of the largest one)."""
    if weight_format(cfg) != "fp8":
        return 0.0
    w13 = cfg["n_routed_experts"] * 2 * cfg["moe_intermediate_size"] / tp * cfg["hidden_size"]
    return w13 * 2.0


def kv_bytes_per_token_layer(cfg: dict) -> int:
    return (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]) * KV_CACHE_BYTES_PER_ELEMENT


def fit_layers(name: str, tp: int, gpu_mem_bytes: float, mem_fraction_static: float = 0.8,
               kv_tokens: int = 262144, weights: str = "auto", draft_bytes: float = 0.0,
               reserve_bytes: float = 4 * 2**30, max_layers: int = K2_LAYERS) -> int:
    """The most decoder layers of model `name` whose weights and KV cache fit one GPU's
    static pool (gpu_mem_bytes * mem_fraction_static), leaving `reserve_bytes` spare.

    kv_tokens: KV-cache tokens to leave room for (the longest context plus decode tokens).
    Raises ValueError when not even first_k_dense_replace + 1 layers fit.
    """
    cfg = model_config(name, None, weights)
    budget = gpu_mem_bytes * mem_fraction_static - reserve_bytes - draft_bytes
    budget -= embedding_bytes(cfg, tp) + dummy_init_peak_bytes(cfg, tp)
    kv_layer = kv_bytes_per_token_layer(cfg) * kv_tokens
    dense = int(cfg.get("first_k_dense_replace", 0))
    budget -= dense * (layer_weight_bytes(cfg, tp, moe=False) + kv_layer)
    per_moe = layer_weight_bytes(cfg, tp, moe=True) + kv_layer
    n_moe = int(budget // per_moe) if budget > 0 else 0
    if n_moe < 1:
        raise ValueError(
            f"{name} at tp={tp} does not fit: one MoE layer needs {per_moe / 2**30:.1f} GiB, "
            f"{max(budget, 0) / 2**30:.1f} GiB left of {gpu_mem_bytes * mem_fraction_static / 2**30:.1f} GiB")
    return min(dense + n_moe, max_layers)


def describe_model(name: str, layers: int | None = None, tp: int = 1, weights: str = "auto") -> str:
    """A few lines naming a model's per-GPU shape and weight footprint (deterministic)."""
    cfg = model_config(name, layers, weights)
    n, dense = cfg["num_hidden_layers"], int(cfg.get("first_k_dense_replace", 0))
    gib = layer_weight_bytes(cfg, tp) / 2**30
    return "\n".join([
        f"model {name}: {n} layers ({dense} dense + {n - dense} MoE), weights {weight_format(cfg)}",
        f"  per GPU at tp={tp}: {heads_per_rank(cfg, tp)} MLA heads (kv_lora_rank {cfg['kv_lora_rank']}, "
        f"rope {cfg['qk_rope_head_dim']}, nope {cfg['qk_nope_head_dim']}, v {cfg['v_head_dim']}), "
        f"{cfg['n_routed_experts']} experts top-{cfg['num_experts_per_tok']} + {cfg['n_shared_experts']} shared, "
        f"expert width {cfg['moe_intermediate_size'] // tp}",
        f"  weights per MoE layer and GPU: {gib:.2f} GiB; KV cache per token and layer: "
        f"{kv_bytes_per_token_layer(cfg)} B; context limit {max_context(cfg)}",
    ])
