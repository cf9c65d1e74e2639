"""What parts of the fast path to use; one object shared by the TrainingArguments flag, the
explicit apply functions and the per-family patches.

The defaults are the benchmarked path. Each part applies wherever it can (fused projections need
plain Linear weights built while the fast path is enabled; SwiGLU recompute needs the fused
gate/up projection and a plain Linear down_proj); where it cannot (LoRA, tensor or pipeline
parallel layers, a model built before enabling), the layer keeps PaddleNLP's sub-layers and one
info line says so.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

PRECISIONS = ("bf16", "fp8")


@dataclass(frozen=True)
class FastFFNOptions:
    swiglu: bool = True  # fused SwiGLU in the MLP
    rms_norm: bool = True  # fused RMSNorm, and residual add + post-attention norm in one pass
    rotary: bool = True  # fused rotary embedding on q and k
    attention: bool = True  # the device's best SDPA kernel (flash attention on GPU)
    # Build PaddleNLP's fused qkv_proj / gate_up_fused_proj (one GEMM each) for models built while
    # enabled; PaddleNLP fuses unfused checkpoints on load.
    fuse_projections: bool = True
    swiglu_recompute: bool = True  # recompute the SwiGLU output in backward (saves [T, I] per layer)
    # save_pretrained of a model whose projections the fast path fused writes PaddleNLP's fused
    # layout (qkv_proj, gate_up_fused_proj; config fuse_attention_* true) instead of the stock
    # unfused one (q/k/v_proj, gate_proj/up_proj), which is the default.
    save_fused_checkpoint: bool = False
    # LlamaForCausalLM's training loss through ops.linear_cross_entropy: the LM head GEMM and
    # PaddleNLP's criterion in chunks of tokens, never the [tokens, vocab] logits; where the head
    # is a plain [H, V] weight or the tied embedding (not tensor parallel). Logits are not returned
    # on that path (training forwards with labels only; eval and generation keep stock).
    fused_cross_entropy: bool = True
    # PaddleNLP's Trainer builds paddle_fastffn.optim.FastAdamW where it would build
    # paddle.optimizer.AdamW (optim="adamw"): the same optimizer, state and checkpoints, with the
    # per-parameter update as one pass of our kernel (fp32 master weights and moments under AMP
    # O2) and ClipGradByGlobalNorm folded into it (integration/trainer.py).
    fused_optimizer: bool = True
    # GEMM precision of the decoder layers' linear layers. "bf16": the activation dtype (bf16
    # under AMP O2). "fp8": per-tensor scaled FP8 GEMMs, with the recipe below: the MLP as one
    # FP8 FFN (paddle_fastffn.fp8.Fp8FFN, SwiGLU fused with quantising its output) where its
    # fused projections are plain Linear layers, every other linear through
    # paddle_fastffn.fp8.Fp8Linear (plain Linear and LoRA's base GEMM; LoRA adapters stay in the
    # activation dtype). Parameters and checkpoints keep their dtypes: FP8 is a compute format
    # only. Where FP8 cannot run, one warning and the bf16 path (integration/llama.py: resolve_fp8).
    precision: str = "bf16"
    # Fp8Recipe's fields, with the "fp8_" prefix (Fp8Recipe.from_dict validates them).
    fp8_scaling: str = "delayed"
    fp8_amax_history_len: int = 1024
    fp8_amax_compute_algo: str = "max"
    fp8_margin: float = 0.0
    fp8_first_last_bf16: bool = False
    fp8_min_gemm_size: int = 0
    fp8_delayed_warm_start: bool = True
    fp8_saved_gate_up: str = "fp8"
    # Run FP8 emulated (same scaling, e4m3/e5m2 rounding, fp32 GEMMs) where the FP8 GEMMs cannot
    # run: CPU CI, and checking recipes and checkpoints. No speed-up; without it FP8 on CPU warns
    # once and trains in bf16/fp32.
    fp8_emulate: bool = False

    def __post_init__(self):
        if self.precision not in PRECISIONS:
            raise ValueError(f"FastFFNOptions.precision (fast_ffn_precision) must be one of {list(PRECISIONS)}, "
                             f"got {self.precision!r}")
        if not isinstance(self.fp8_emulate, bool):
            raise ValueError(f"FastFFNOptions.fp8_emulate must be bool, got {self.fp8_emulate!r}")
        self.fp8_recipe()  # validates the recipe fields even while precision is bf16

    def fp8_recipe(self):
        """The Fp8Recipe of the fp8_* fields."""
        from ..fp8.recipe import Fp8Recipe

        recipe_fields = {f"fp8_{f.name}" for f in fields(Fp8Recipe)}
        values = {name: value for name, value in asdict(self).items() if name in recipe_fields}
        return Fp8Recipe.from_dict(values, prefix="fp8_")

    def as_dict(self) -> dict:
        return asdict(self)
