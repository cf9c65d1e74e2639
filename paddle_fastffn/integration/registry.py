"""model_type -> the module that patches that model family (one file per family, each a
family.ModelFamily); enabling and disabling the fast path for all of them. Nothing here knows a
family's classes: only the contract of family.py."""

from __future__ import annotations

import warnings

from . import fp8_attach, llama, messages, state, trainer
from .family import ModelFamily, check_family
from .options import FastFFNOptions

FAMILIES: dict = {}


def register(family: ModelFamily) -> None:
    """Serve `family`'s model types (checked against the contract first)."""
    check_family(family)
    for model_type in family.MODEL_TYPES:
        if FAMILIES.get(model_type, family) is not family:
            raise ValueError(f"paddle_fastffn: model_type {model_type!r} is served by "
                             f"{FAMILIES[model_type].__name__} already")
        FAMILIES[model_type] = family


register(llama)


def registered_families() -> list:
    """Each registered family once, in registration order."""
    return list(dict.fromkeys(FAMILIES.values()))


def supported_model_types() -> tuple[str, ...]:
    return tuple(sorted(FAMILIES))


def family_for(model_type: str) -> ModelFamily:
    try:
        return FAMILIES[model_type]
    except KeyError:
        raise ValueError(
            f"paddle_fastffn: use_fast_ffn supports LLaMA-style decoder layers (model_type in "
            f"{supported_model_types()}); this model has model_type={model_type!r}. Remove "
            f"use_fast_ffn or use a LLaMA-architecture checkpoint.") from None


def _install_construction_hook() -> None:
    """Apply config-level choices (SDPA, fused projections) to every model of a supported family
    built while the fast path is enabled (each family's decoder layer __init__ sees the config
    before its attention and MLP sub-layers read it), and the checkpoint hooks that keep what such
    a model saves and loads stock. Installed once; they act only on what the fast path built."""
    for family in registered_families():
        family.install_hooks(enabled_options)


def enable(options: FastFFNOptions) -> None:
    """Every supported family's layers built or run from now on use the fast path. FP8 that cannot
    run here (and no fallback asked for) raises before anything is patched."""
    fp8_attach.check_fp8_runs(options)
    state.set_current(options)
    _install_construction_hook()
    for family in registered_families():
        family.apply(options)
    trainer.apply(options)


def disable() -> None:
    state.set_current(None)
    for family in registered_families():
        family.revert()
    trainer.revert()
    messages.forget()


def enabled_options() -> FastFFNOptions | None:
    return state.current()


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
