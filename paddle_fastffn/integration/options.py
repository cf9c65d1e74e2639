"""What parts of the fast path to use; one object shared by the TrainingArguments flag, the
explicit apply functions and the per-family patches."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class FastFFNOptions:
    swiglu: bool = True  # fused SwiGLU in the MLP
    rms_norm: bool = True  # fused RMSNorm, and residual add + post-attention norm in one pass
    rotary: bool = True  # fused rotary embedding on q and k
    attention: bool = True  # the device's best SDPA kernel (flash attention on GPU)
    fuse_projections: bool = False  # build gate_up_fused_proj / qkv_proj (PaddleNLP converts on load)
    swiglu_recompute: bool = False  # recompute the SwiGLU output in backward (saves [T, I] per layer)

    def as_dict(self) -> dict:
        return asdict(self)
