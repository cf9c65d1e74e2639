"""paddle_fastffn: fused, mixed-precision FFN (SwiGLU), RMSNorm, rotary and attention paths for
fine-tuning LLaMA-style models with PaddleNLP. Public API only; see README.md."""

from __future__ import annotations

# Nothing Paddle is imported here: paddle_fastffn.core (the framework-neutral layer) is imported by
# the torch GPU harness on a machine without Paddle. The public names below load on first use.

__version__ = "0.1.0"


def apply_fast_ffn_to_llama(model=None, swiglu: bool = True, rms_norm: bool = True,
                            rotary: bool = True, attention: bool = True,
                            fuse_projections: bool = True, swiglu_recompute: bool = True,
                            save_fused_checkpoint: bool = False,
                            fused_cross_entropy: bool = True, fused_optimizer: bool = True,
                            optimizer_moments: str = "fp32", optimizer_master_weights: str = "fp32",
                            precision: str = "bf16",
                            **fp8_options) -> int:
    """Patch PaddleNLP's LLaMA decoder layers with the fused paths (class level: every layer
    built or run afterwards), and `model`'s settings when given. Returns the number of decoder
    layers of `model` on the fast path (0 without a model). Undo with revert_fast_ffn().

    The defaults are the benchmarked path: models built afterwards get fused qkv / gate_up
    projections (plain Linear weights only: LoRA and tensor-parallel layers keep PaddleNLP's
    sub-layers) and SwiGLU recompute; save_pretrained still writes the stock unfused LLaMA
    checkpoint unless save_fused_checkpoint. Fused projections are chosen when a model is built:
    an existing `model` keeps its projections.

    fused_cross_entropy: LlamaForCausalLM's training loss (a forward with labels in train mode)
    through ops.linear_cross_entropy, which never builds the [tokens, vocab] logits; that forward
    returns logits=None. Eval, generation and forwards without labels keep the stock head.

    fused_optimizer: PaddleNLP's Trainer builds paddle_fastffn.optim.FastAdamW where it would build
    paddle.optimizer.AdamW (same state and checkpoints; one fused pass per parameter).
    optimizer_moments="int8" / optimizer_master_weights="compensated": its low-memory state
    (FastFFNOptions says what each keeps; checkpoints stay Paddle's).

    precision="fp8": the decoder layers' linear GEMMs in FP8 (FastFFNOptions.precision), with the
    recipe and emulation keywords of FastFFNOptions (fp8_scaling=..., fp8_emulate=True, ...). Where
    FP8 can run neither on an sm_90 GPU nor emulated, this raises before patching anything, unless
    fp8_fallback="bf16" (one warning, the bf16 path)."""
    from .integration import FastFFNOptions, enable, library

    if library.active() == library.PADDLENLP:
        from .finetune import checkpoint  # noqa: F401  (offers the patch its Hub-folder loader)
    from .integration.registry import apply_to_model

    options = FastFFNOptions(swiglu=swiglu, rms_norm=rms_norm, rotary=rotary, attention=attention,
                             fuse_projections=fuse_projections, swiglu_recompute=swiglu_recompute,
                             save_fused_checkpoint=save_fused_checkpoint,
                             fused_cross_entropy=fused_cross_entropy, fused_optimizer=fused_optimizer,
                             optimizer_moments=optimizer_moments, optimizer_master_weights=optimizer_master_weights,
                             precision=precision, **fp8_options)
    if model is None:
        enable(options)
        return 0
    return apply_to_model(model, options)


def __getattr__(name):
    # Imported on first use (PEP 562): Paddle for ops and the integration; paddlenlp.trainer for
    # FastFFNTrainingArguments, which plain op users do not need.
    import importlib

    if name == "ops":
        return importlib.import_module(".ops", __name__)
    if name in ("FastFFNOptions", "supported_model_types"):
        return getattr(importlib.import_module(".integration", __name__), name)
    if name == "revert_fast_ffn":
        return importlib.import_module(".integration", __name__).disable
    if name == "FastFFNTrainingArguments":
        from .integration import library, training_args

        if library.active() == library.PADDLENLP:
            from .finetune import checkpoint  # noqa: F401  (offers the patch its Hub-folder loader)
        return training_args.FastFFNTrainingArguments
    raise AttributeError(f"module 'paddle_fastffn' has no attribute {name!r}")


__all__ = ["FastFFNOptions", "FastFFNTrainingArguments", "apply_fast_ffn_to_llama", "ops",
           "revert_fast_ffn", "supported_model_types", "__version__"]
