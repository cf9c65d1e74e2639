"""The families the fast path serves (one file per family, each a family.ModelFamily, registered
into family.py's table here) and their state; enabling and disabling the fast path for all of them.
Nothing here knows a family's classes: only the contract of family.py."""

from __future__ import annotations

import warnings

from . import fp8_attach, library, llama, lora_forward, messages, mixtral, paddleformers_llama, state, trainer
from .family import FAMILIES, family_for, register, registered_families, supported_model_types  # noqa: F401
from .options import FastFFNOptions
from .state import FamilyState

# One file per family; the installed library's families serve (library.py: PaddleNLP and
# PaddleFormers cannot share an environment, and both have a LLaMA).
ALL_FAMILIES = (llama, mixtral, paddleformers_llama)
for _family in ALL_FAMILIES:
    if _family.LIBRARY == library.active():
        register(_family)


def family_state(model_type: str) -> FamilyState:
    """The patch state (state.FamilyState) of the family serving `model_type`."""
    return state.for_family(family_for(model_type).__name__.rpartition(".")[2])


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
    lora_forward.detach_all_lora_forwards()
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
