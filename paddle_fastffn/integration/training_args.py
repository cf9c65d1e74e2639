"""FastFFNTrainingArguments: PaddleNLP's TrainingArguments plus the `use_fast_ffn` flag.

Parsed like PaddleNLP's own scripts do (PdArgumentParser: a JSON file, command-line flags
overriding it). With use_fast_ffn=True the fast path is enabled as the arguments are built, so
the model constructed afterwards (from_pretrained / from_config / direct) is patched at
construction.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

from paddlenlp.trainer import TrainingArguments

from .options import FastFFNOptions
from .registry import enable


@dataclass
class FastFFNTrainingArguments(TrainingArguments):
    use_fast_ffn: bool = field(default=False, metadata={
        "help": "Patch LLaMA-style decoder layers with paddle_fastffn's fused SwiGLU, RMSNorm, rotary and "
                "attention paths when the model is built."})
    fast_ffn_swiglu: bool = field(default=True, metadata={"help": "Fused SwiGLU in the MLP."})
    fast_ffn_rms_norm: bool = field(default=True, metadata={
        "help": "Fused RMSNorm, and the attention residual add fused into the post-attention norm."})
    fast_ffn_rotary: bool = field(default=True, metadata={"help": "Fused rotary embedding on q and k."})
    fast_ffn_attention: bool = field(default=True, metadata={
        "help": "Use the device's SDPA kernel (flash attention on GPU) via use_flash_attention."})
    fast_ffn_fuse_projections: bool = field(default=False, metadata={
        "help": "Build fused qkv_proj and gate_up_fused_proj (one GEMM each); PaddleNLP converts "
                "unfused checkpoints on load and stock PaddleNLP splits them back."})
    fast_ffn_swiglu_recompute: bool = field(default=False, metadata={
        "help": "Recompute the SwiGLU output in backward instead of storing it (fused gate_up only)."})

    def fast_ffn_options(self) -> FastFFNOptions:
        return FastFFNOptions(swiglu=self.fast_ffn_swiglu, rms_norm=self.fast_ffn_rms_norm,
                              rotary=self.fast_ffn_rotary, attention=self.fast_ffn_attention,
                              fuse_projections=self.fast_ffn_fuse_projections,
                              swiglu_recompute=self.fast_ffn_swiglu_recompute)

    def __post_init__(self):
        super().__post_init__()
        if not self.use_fast_ffn:
            return
        enable(self.fast_ffn_options())
        import paddle

        if (self.bf16 or self.fp16) and not paddle.is_compiled_with_cuda():
            warnings.warn("paddle_fastffn: this Paddle build has no GPU, and Paddle's CPU AMP is a no-op: "
                          "training runs in float32 (the fused kernels support bf16/fp16 where AMP runs).",
                          RuntimeWarning, stacklevel=2)
