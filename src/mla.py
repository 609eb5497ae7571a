"""The absorbed-MLA shapes every part of the workbook shares (DeepSeek-V3, Kimi K2).

Each token keeps one KV row of DIM_QK values (the 512-wide latent plus 64 rope dims),
shared by all query heads; V is the row's first DIM_V values.
"""
import math

KV_LORA_RANK = 512                  # latent width: V, and the first 512 dims of K
QK_ROPE_DIM = 64
QK_NOPE_DIM = 128
DIM_QK = KV_LORA_RANK + QK_ROPE_DIM  # 576
DIM_V = KV_LORA_RANK                 # 512
KV_BYTES_PER_TOKEN = DIM_QK * 2      # one bf16 KV row: 1152 B per token and layer
SM_SCALE = 1.0 / (QK_NOPE_DIM + QK_ROPE_DIM) ** 0.5   # 1/sqrt(192): the scale before YaRN's mscale


def yarn_sm_scale(factor: float, mscale_all_dim: float) -> float:
    """The softmax scale SGLang gives an MLA model whose rope_scaling is YaRN with this `factor`
    and `mscale_all_dim` (`compute_mla_mscale_scaling`; a config without mscale_all_dim reads as
    0 there, no change): 1/sqrt(192) x mscale^2, mscale = 0.1 x mscale_all_dim x ln(factor) + 1
    (1 for a factor up to 1)."""
    mscale = 1.0 if factor <= 1 else 0.1 * mscale_all_dim * math.log(factor) + 1.0
    return SM_SCALE * mscale * mscale


DEEPSEEK_V3_SM_SCALE = yarn_sm_scale(40, 1.0)   # 0.1352: rope_scaling factor 40, mscale_all_dim 1
KIMI_K2_SM_SCALE = yarn_sm_scale(32, 1.0)       # 0.1309: factor 32, mscale_all_dim 1
# The scales the checks draw from: the real models' (a sharper softmax) and the bare one.
SM_SCALES = (SM_SCALE, KIMI_K2_SM_SCALE, DEEPSEEK_V3_SM_SCALE)
