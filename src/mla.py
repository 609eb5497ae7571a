"""The absorbed-MLA shapes every part of the workbook shares (DeepSeek-V3, Kimi K2).

Each token keeps one KV row of DIM_QK values (the 512-wide latent plus 64 rope dims),
shared by all query heads; V is the row's first DIM_V values.
"""
KV_LORA_RANK = 512                  # latent width: V, and the first 512 dims of K
QK_ROPE_DIM = 64
QK_NOPE_DIM = 128
DIM_QK = KV_LORA_RANK + QK_ROPE_DIM  # 576
DIM_V = KV_LORA_RANK                 # 512
KV_BYTES_PER_TOKEN = DIM_QK * 2      # one bf16 KV row: 1152 B per token and layer
SM_SCALE = 1.0 / (QK_NOPE_DIM + QK_ROPE_DIM) ** 0.5   # softmax scale 1/sqrt(192)
