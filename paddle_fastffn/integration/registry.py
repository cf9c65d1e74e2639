"""model_type -> the module that patches that model family. One file per family."""

from __future__ import annotations

import warnings

from . import llama, trainer
from .options import FastFFNOptions

FAMILIES = {model_type: llama for model_type in llama.MODEL_TYPES}
_ENABLED: FastFFNOptions | None = None


def supported_model_types() -> tuple[str, ...]:
    return tuple(sorted(FAMILIES))


def family_for(model_type: str):
    try:
        return FAMILIES[model_type]
    except KeyError:
        raise ValueError(
            f"paddle_fastffn: use_fast_ffn supports LLaMA-style decoder layers (model_type in "
            f"{supported_model_types()}); this model has model_type={model_type!r}. Remove "
            f"use_fast_ffn or use a LLaMA-architecture checkpoint.") from None


def _install_construction_hook() -> None:
    """Apply config-level choices (SDPA, fused projections) to every model of a supported family
    built while the fast path is enabled (each family's LlamaDecoderLayer-style __init__ sees the
    config before its attention and MLP sub-layers read it), and the checkpoint hooks that keep
    what such a model saves and loads stock. Installed once; they act only on what the fast path
    built."""
    for family in set(FAMILIES.values()):
        family.install_hooks(enabled_options)


def enable(options: FastFFNOptions) -> None:
    """Every supported family's layers built or run from now on use the fast path."""
    global _ENABLED
    _ENABLED = options
    _install_construction_hook()
    for family in set(FAMILIES.values()):
        family.apply(options)
    trainer.apply(options)


def disable() -> None:
    global _ENABLED
    _ENABLED = None
    for family in set(FAMILIES.values()):
        family.revert()
    trainer.revert()


def enabled_options() -> FastFFNOptions | None:
    return _ENABLED


def apply_to_model(model, options: FastFFNOptions) -> int:
    """Patch the family of `model` (class level) and its instance settings; returns the number of
    decoder layers now on the fast path. Raises for unsupported models."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    family = family_for(model_type)
    enable(options)
    family.apply(options, model=model)
    count = family.patched_layer_count(model)
    if count == 0:
        warnings.warn(f"paddle_fastffn: no decoder layer of this {model_type} model was patched",
                      RuntimeWarning, stacklevel=2)
    return count
