"""What parts of the fast path to use; one object shared by the TrainingArguments flag, the
explicit apply functions and the per-family patches.

The defaults are the benchmarked path. Each part applies wherever it can (fused projections need
plain Linear weights built while the fast path is enabled; SwiGLU recompute needs the fused
gate/up projection and a plain Linear down_proj); where it cannot (LoRA, tensor or pipeline
parallel layers, a model built before enabling), the layer keeps PaddleNLP's sub-layers and one
info line says so.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


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

    def as_dict(self) -> dict:
        return asdict(self)
