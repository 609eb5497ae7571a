"""The sm_120 MLA verify-attention kernel (CUDA in mla_verify.cuh / mla_verify.cu)."""
from .verify_attention import (DIM_QK, DIM_V, MAX_Q_LEN, MlaVerifyWorkspace, choose_num_splits,
                               kernel_available, mla_verify_attention)

__all__ = ["DIM_QK", "DIM_V", "MAX_Q_LEN", "MlaVerifyWorkspace", "choose_num_splits", "kernel_available",
           "mla_verify_attention"]
