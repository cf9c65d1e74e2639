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
    fast_ffn_fuse_projections: bool = field(default=True, metadata={
        "help": "Build fused qkv_proj and gate_up_fused_proj (one GEMM each) where the weights are plain "
                "Linear layers (not under tensor/pipeline parallel; LoRA gets the stock sub-layers back); "
                "PaddleNLP fuses unfused checkpoints on load."})
    fast_ffn_swiglu_recompute: bool = field(default=True, metadata={
        "help": "Recompute the SwiGLU output in backward instead of storing it (where gate/up are fused "
                "and down_proj is a plain Linear)."})
    fast_ffn_save_fused_checkpoint: bool = field(default=False, metadata={
        "help": "Save PaddleNLP's fused layout (qkv_proj, gate_up_fused_proj, fuse_attention_* in "
                "config.json) instead of the stock unfused LLaMA layout that the fast path saves by default."})
    fast_ffn_fused_cross_entropy: bool = field(default=True, metadata={
        "help": "Training loss of LlamaForCausalLM as one fused LM head + cross-entropy in chunks of tokens "
                "(never the [tokens, vocab] fp32 logits; PaddleNLP's loss). Needs a plain LM head weight or "
                "tied embeddings, not tensor parallel; the training forward then returns no logits."})
    fast_ffn_fused_optimizer: bool = field(default=True, metadata={
        "help": "Build paddle_fastffn.optim.FastAdamW where the Trainer builds paddle.optimizer.AdamW: the same "
                "optimizer and checkpoints, each parameter updated in one pass of a fused kernel, global-norm "
                "clipping folded into it."})
    fast_ffn_precision: str = field(default="bf16", metadata={
        "help": "GEMM precision of the decoder layers' linear layers: \"bf16\" (the activation dtype) or \"fp8\" "
                "(per-tensor scaled FP8 GEMMs, the MLP as one FP8 FFN with SwiGLU fused into its quantisation; LoRA "
                "adapters stay bf16 over an FP8 base GEMM; parameters and checkpoints keep their dtypes). Where FP8 "
                "cannot run: one warning, and bf16."})
    fast_ffn_fp8_scaling: str = field(default="delayed", metadata={
        "help": "FP8 scaling: \"delayed\" (amax history, Transformer Engine's DelayedScaling) or \"current\"."})
    fast_ffn_fp8_amax_history_len: int = field(default=1024, metadata={
        "help": "FP8 delayed scaling: amax history length."})
    fast_ffn_fp8_amax_compute_algo: str = field(default="max", metadata={
        "help": "FP8 delayed scaling: \"max\" or \"most_recent\" over the amax history."})
    fast_ffn_fp8_margin: float = field(default=0.0, metadata={
        "help": "FP8 scale = fp8_max / amax / 2^margin."})
    fast_ffn_fp8_first_last_bf16: bool = field(default=False, metadata={
        "help": "Keep the first and last decoder layers' GEMMs in bf16 under fast_ffn_precision=fp8."})
    fast_ffn_fp8_min_gemm_size: int = field(default=0, metadata={
        "help": "GEMMs with M*N*K below this stay bf16 under fast_ffn_precision=fp8."})
    fast_ffn_fp8_delayed_warm_start: bool = field(default=True, metadata={
        "help": "FP8 delayed scaling: quantise each tensor's first use with its own amax (current scaling) and seed "
                "its amax history with it; false: Transformer Engine's exact behaviour (every scale starts at 1, "
                "so the first steps' e5m2 gradients can underflow to zero)."})
    fast_ffn_fp8_saved_gate_up: str = field(default="fp8", metadata={
        "help": "What the FP8 FFN keeps of its gate_up projection output for backward: \"fp8\" (its own "
                "per-tensor scaled e4m3 copy, 1 byte an element, written by the SwiGLU forward pass) or "
                "\"activation\" (the bf16/fp16 tensor, 2 bytes an element)."})
    fast_ffn_fp8_emulate: bool = field(default=False, metadata={
        "help": "Run fast_ffn_precision=fp8 emulated (FP8 rounding and scaling, fp32 GEMMs; no speed-up) where "
                "FP8 GEMMs cannot run, e.g. on CPU for tests and to check recipes and checkpoints."})

    def fast_ffn_options(self) -> FastFFNOptions:
        fuse = self.fast_ffn_fuse_projections and not self._checkpoint_writer_without_split()
        return FastFFNOptions(swiglu=self.fast_ffn_swiglu, rms_norm=self.fast_ffn_rms_norm,
                              rotary=self.fast_ffn_rotary, attention=self.fast_ffn_attention,
                              fuse_projections=fuse, swiglu_recompute=self.fast_ffn_swiglu_recompute,
                              save_fused_checkpoint=self.fast_ffn_save_fused_checkpoint,
                              fused_cross_entropy=self.fast_ffn_fused_cross_entropy,
                              fused_optimizer=self.fast_ffn_fused_optimizer,
                              precision=self.fast_ffn_precision, fp8_scaling=self.fast_ffn_fp8_scaling,
                              fp8_amax_history_len=self.fast_ffn_fp8_amax_history_len,
                              fp8_amax_compute_algo=self.fast_ffn_fp8_amax_compute_algo,
                              fp8_margin=float(self.fast_ffn_fp8_margin),
                              fp8_first_last_bf16=self.fast_ffn_fp8_first_last_bf16,
                              fp8_min_gemm_size=self.fast_ffn_fp8_min_gemm_size,
                              fp8_delayed_warm_start=self.fast_ffn_fp8_delayed_warm_start,
                              fp8_saved_gate_up=self.fast_ffn_fp8_saved_gate_up,
                              fp8_emulate=self.fast_ffn_fp8_emulate)

    def _checkpoint_writer_without_split(self) -> str | None:
        """The option whose checkpoint writer saves model.state_dict() as it is (no save_pretrained
        split): fused projections would leave a fused checkpoint, so they stay off unless
        fast_ffn_save_fused_checkpoint asks for the fused layout."""
        if self.fast_ffn_save_fused_checkpoint:
            return None
        if getattr(self, "unified_checkpoint", False):
            return "unified_checkpoint"
        if getattr(self, "save_sharded_model", False):
            return "save_sharded_model (sharding stage 1)"
        return None

    def __post_init__(self):
        super().__post_init__()
        options = self.fast_ffn_options()  # validates fast_ffn_precision and the FP8 recipe fields
        if not self.use_fast_ffn:
            return
        writer = self._checkpoint_writer_without_split() if self.fast_ffn_fuse_projections else None
        if writer:
            from paddlenlp.utils.log import logger

            logger.info(f"paddle_fastffn: {writer} writes the model's own parameters: projections stay unfused "
                        f"so checkpoints keep the stock layout (fast_ffn_save_fused_checkpoint=true fuses them and "
                        f"saves PaddleNLP's fused layout)")
        enable(options)
        import paddle

        if (self.bf16 or self.fp16) and not paddle.is_compiled_with_cuda():
            warnings.warn("paddle_fastffn: this Paddle build has no GPU, and Paddle's CPU AMP is a no-op: "
                          "training runs in float32 (the fused kernels support bf16/fp16 where AMP runs).",
                          RuntimeWarning, stacklevel=2)
