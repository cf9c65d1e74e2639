"""paddle_fastffn: fused, mixed-precision FFN (SwiGLU), RMSNorm, rotary and attention paths for
fine-tuning LLaMA-style models with PaddleNLP. Public API only; see README.md."""

from __future__ import annotations

from . import ops
from .integration import FastFFNOptions, supported_model_types
from .integration import disable as revert_fast_ffn
from .integration import enable as _enable
from .integration.registry import apply_to_model as _apply_to_model

__version__ = "0.1.0"


def apply_fast_ffn_to_llama(model=None, swiglu: bool = True, rms_norm: bool = True,
                            rotary: bool = True, attention: bool = True,
                            fuse_projections: bool = True, swiglu_recompute: bool = True,
                            save_fused_checkpoint: bool = False,
                            fused_cross_entropy: bool = True, fused_optimizer: bool = True,
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

    precision="fp8": the decoder layers' linear GEMMs in FP8 (FastFFNOptions.precision), with the
    recipe and emulation keywords of FastFFNOptions (fp8_scaling=..., fp8_emulate=True, ...)."""
    options = FastFFNOptions(swiglu=swiglu, rms_norm=rms_norm, rotary=rotary, attention=attention,
                             fuse_projections=fuse_projections, swiglu_recompute=swiglu_recompute,
                             save_fused_checkpoint=save_fused_checkpoint,
                             fused_cross_entropy=fused_cross_entropy, fused_optimizer=fused_optimizer,
                             precision=precision, **fp8_options)
    if model is None:
        _enable(options)
        return 0
    return _apply_to_model(model, options)


def __getattr__(name):
    # Imported lazily: it pulls in paddlenlp.trainer, which plain op users do not need.
    if name == "FastFFNTrainingArguments":
        from .integration.training_args import FastFFNTrainingArguments

        return FastFFNTrainingArguments
    raise AttributeError(name)


__all__ = ["FastFFNOptions", "FastFFNTrainingArguments", "apply_fast_ffn_to_llama", "ops",
           "revert_fast_ffn", "supported_model_types", "__version__"]
