"""The contract of a model family: what one file per family (integration/llama.py, ...) provides so
that the registry and the family-neutral modules can put that family on the fast path.

A family is a module (or any object) with the members of ModelFamily below. The family-neutral
parts do the rest for every family:
- options.py / state.py: the options (declared once) and the one store of the active ones;
- messages.py: warnings and info lines, once per reason;
- fused_projections.py: the fused projections' records, their stock initialisation and the stock
  checkpoint layout (save_pretrained / set_state_dict wrappers), driven by the family's
  FUSED_LAYOUTS, fuse_fn and split_fn;
- lora.py: LoRA on the stock sub-layers (the family's split_fn and unfused_linear_class);
- patching.py: class attributes saved and restored exactly.
This module also holds the table of registered families (register, family_for): the family-neutral
modules (lora.py, resume.py, report.py) find a model's family here, never through registry.py,
which imports the families. registry.py relies on nothing but this contract (register checks it), and
tests/integration/test_family_contract.py checks every registered family against it: its members,
that apply() changes only the attributes it declares and revert() restores every one of them, and
that its fused layouts fuse, split and save as declared.

Adding a family (say PaddleNLP's Qwen2): a file integration/qwen2.py with these members, its fast
forwards written against its own modeling module, and one `register(qwen2)` line in registry.py.
Its patch state lives in one state.FamilyState (state.for_family), not in module globals. A family
whose patch is one table of attributes and that fuses no projection (mixtral.py,
paddleformers_llama.py) takes most members from a TableFamily (below) instead of spelling them out.
"""

from __future__ import annotations

from types import ModuleType
from typing import Callable, Protocol, runtime_checkable

from . import fp8_attach, state
from .options import FastFFNOptions


@runtime_checkable
class ModelFamily(Protocol):
    # --- what the family serves ---------------------------------------------------------------
    MODEL_TYPES: tuple
    """The config.model_type values this family serves (the registry's keys)."""

    LIBRARY: str
    """The library whose models it patches ("paddlenlp" or "paddleformers", library.py): registry.py
    registers the families of the installed one."""

    def modeling_module(self) -> ModuleType:
        """The library's modeling module whose classes and functions the family patches (imported
        on first use: importing the family imports no PaddleNLP model)."""

    def example_config(self, **overrides):
        """A small config of this family (a couple of layers, widths that every fused kernel and
        FP8's alignment accept, `architectures` naming its causal LM so that PaddleNLP's
        AutoModelForCausalLM.from_config builds it), for the contract test."""

    # --- the patch: class attributes and module functions ---------------------------------------
    def patched_attributes(self) -> tuple:
        """((owner, attribute name), ...): every class attribute or module-level function apply()
        may replace by its fast version (forwards, the rotary and attention functions, ...);
        revert() restores each one exactly (patching.own_attribute / restore_attribute) and
        nothing else may change."""

    def hooked_attributes(self) -> tuple:
        """((owner, attribute name), ...) that install_hooks() wraps once per process and keeps
        (construction and checkpoint hooks: they act only on what the fast path built, so a stock
        model keeps its stock behaviour)."""

    def install_hooks(self, enabled_options: Callable) -> None:
        """Install, once, the construction hook (configure() before a decoder layer reads its
        config, mark_fast_built() after, while enabled_options() is not None) and the checkpoint
        hooks of fused_projections on the family's pretrained-model class."""

    def apply(self, options, model=None) -> None:
        """Patch the family's classes for `options` (every layer built or run from now on) and,
        when given, `model`'s instance settings."""

    def revert(self) -> None:
        """Restore every attribute of patched_attributes() and forget the family's runtime state."""

    # --- decoder layers ------------------------------------------------------------------------
    def decoder_layers(self, model) -> list:
        """The decoder layers of `model` (any model of the family: the base model, the causal LM,
        a LoRA or other wrapper's inner model), in order."""

    def patched_layer_count(self, model) -> int:
        """How many decoder layers of `model` run the fast forward (0 while the fast path is off)."""

    # --- fused projections and the checkpoint layout --------------------------------------------
    FUSED_LAYOUTS: dict
    """{kind: fused_projections.FusedLayout(fused sub-layer name, stock part names in PaddleNLP's
    order, the config flag that builds the fused one)}. The checkpoint key patterns follow from it:
    the fast model holds `<owner>.<fused>.weight`, a stock checkpoint `<owner>.<part>.weight` for
    each part, and `config.<config_flag>` says which of the two a checkpoint holds."""

    def configure(self, config, options) -> None:
        """Config changes made before a decoder layer is built (fused projections, attention
        kernel); remembers the stock values first (fused_projections.remember_stock)."""

    def mark_fast_built(self, layer, config) -> None:
        """After a decoder layer is built: record each projection the fast path fused
        (fused_projections.mark_fused with its stock parts' widths and fuse_fn)."""

    def fuse_fn(self, kind: str, config) -> Callable:
        """[stock part weights] -> the fused weight, as PaddleNLP's own fuse mapping does."""

    def split_fn(self, kind: str, config) -> Callable:
        """The fused weight -> [stock part weights] (the inverse of fuse_fn)."""

    def unfused_linear_class(self) -> type:
        """The Linear class PaddleNLP builds for the stock parts on this device (LoRA's unfusing
        rebuilds them with it)."""

    # --- FP8 and the run report ----------------------------------------------------------------
    def fp8_checkpoint_layers(self, model) -> tuple:
        """(recipe, {sub-layer name: Fp8Linear or Fp8FFN}) of what computes in FP8 in `model`,
        attached first where no forward has attached it yet; (None, {}) while FP8 is off. The
        Trainer checkpoint saves and restores their scaling state (resume.py)."""

    def fp8_recipe(self):
        """The Fp8Recipe the family's FP8 GEMMs run with, or None (FP8 off or not runnable here)."""

    def causal_lm_class(self) -> type:
        """The family's causal LM class (the one whose training loss the fused LM head computes)."""

    def fused_head_weight(self, model) -> tuple:
        """(weight, transpose_weight, None) where the fused LM head + loss can read `model`'s head
        (a causal_lm_class() model), else (None, False, why not)."""

    def device_keeps_norm(self, config) -> bool:
        """Whether the config's norms keep PaddleNLP's device kernel (NPU / XPU fused norms)."""

    def is_plain_linear(self, layer) -> bool:
        """A Linear whose math is exactly x @ weight (no LoRA adapters, no tensor-parallel comms)."""


# The members a family must have, by name (the Protocol's annotations and methods): what
# register() checks with a message naming the missing ones (isinstance on a Protocol says only
# yes or no).
MEMBERS = tuple(sorted({name for name in ModelFamily.__dict__.get("__annotations__", {})}
                       | {name for name, value in vars(ModelFamily).items()
                          if callable(value) and not name.startswith("_")}))


def missing_members(family) -> list:
    """The contract's members `family` lacks (empty when it satisfies ModelFamily)."""
    return [name for name in MEMBERS if not hasattr(family, name)]


def check_family(family) -> None:
    missing = missing_members(family)
    if missing:
        raise TypeError(f"paddle_fastffn: {getattr(family, '__name__', family)!r} is not a ModelFamily "
                        f"(integration/family.py): it lacks {missing}")
    if not family.MODEL_TYPES or not all(isinstance(t, str) for t in family.MODEL_TYPES):
        raise TypeError(f"paddle_fastffn: {family.__name__}.MODEL_TYPES must be a non-empty tuple of "
                        f"config.model_type strings, got {family.MODEL_TYPES!r}")


# model_type -> the family serving it (register fills it; registry.py registers every family).
FAMILIES: dict = {}


def register(family: ModelFamily) -> None:
    """Serve `family`'s model types (checked against the contract first)."""
    check_family(family)
    for model_type in family.MODEL_TYPES:
        if FAMILIES.get(model_type, family) is not family:
            raise ValueError(f"paddle_fastffn: model_type {model_type!r} is served by "
                             f"{FAMILIES[model_type].__name__} already")
        FAMILIES[model_type] = family


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


class TableFamily:
    """The members of the contract that every family whose patch is one table and that fuses no
    projection spells alike; the family's module binds them (`revert = _TABLE.revert`, ...).

    patches(options) -> {(owner, name): (key in family_state.originals, fast version, or a false
    value for stock)}: patch() sets each attribute, and the modeling module's `recompute` through
    fp8_attach.switch_fp8 while FP8 runs; revert() restores them all. The class names are looked up
    in modeling() when used (importing the family imports no model library). attach_fp8(base model,
    recipe): the family's FP8 attachment, which fp8_checkpoint_layers runs before a resume restores
    the scaling states. The family's module calls bind(globals()) once, after patches and
    attach_fp8 are defined, and defines the other members (apply, configure, ...) itself."""

    # The contract members bind() gives the family's module.
    MEMBERS = ("patched_attributes", "revert", "fuse_fn", "split_fn", "unfused_linear_class", "causal_lm_class",
               "fp8_recipe", "fp8_checkpoint_layers", "decoder_layers", "patched_layer_count")

    def __init__(self, family_state, modeling: Callable, patches: Callable, *, label: str, decoder_layer: str,
                 base_model: str, causal_lm: str, attach_fp8: Callable, info_once: Callable):
        self.state, self.modeling, self.patches, self.label = family_state, modeling, patches, label
        self.names = dict(decoder_layer=decoder_layer, base_model=base_model, causal_lm=causal_lm)
        self.attach_fp8, self.info_once = attach_fp8, info_once

    def bind(self, namespace: dict) -> None:
        """Put MEMBERS into `namespace` (the family module's globals()), refusing to replace one the
        module defines itself."""
        taken = sorted(name for name in self.MEMBERS if name in namespace)
        if taken:
            raise TypeError(f"paddle_fastffn: {self.label}'s module defines {taken} itself; TableFamily.bind "
                            f"gives it those members")
        namespace.update({name: getattr(self, name) for name in self.MEMBERS})

    def _class(self, role: str) -> type:
        return getattr(self.modeling(), self.names[role])

    def patch(self, options) -> None:
        """apply()'s class-level part: once per options (applying the same options again, as the
        TrainingArguments and then apply_fast_ffn_to_llama do, changes nothing)."""
        if self.state.applied == options:
            return
        for (owner, name), (key, fast) in self.patches(options).items():
            self.state.originals.setdefault(key, owner.__dict__[name])
            setattr(owner, name, fast or self.state.originals[key])
        fp8_attach.switch_fp8(self.state, self.modeling(), fp8_attach.resolve_fp8(options, self.info_once))
        self.state.applied = options
        self.state.applications += 1

    def revert(self) -> None:
        self.state.forget()
        if "recompute" in self.state.originals:
            fp8_attach.switch_fp8(self.state, self.modeling(), None)
        for (owner, name), (key, _fast) in self.patches(FastFFNOptions()).items():
            if key in self.state.originals:
                setattr(owner, name, self.state.originals[key])

    def patched_attributes(self) -> tuple:
        return tuple(self.patches(FastFFNOptions())) + ((self.modeling(), "recompute"),)  # the last: FP8 only

    def fuse_fn(self, kind: str, config):
        raise KeyError(f"paddle_fastffn: {self.label} has no fused layout {kind!r}")

    split_fn = fuse_fn

    def unfused_linear_class(self) -> type:
        import paddle

        return paddle.nn.Linear

    def causal_lm_class(self) -> type:
        return self._class("causal_lm")

    def fp8_recipe(self):
        return self.state.fp8

    def fp8_checkpoint_layers(self, model):
        return fp8_attach.checkpoint_layers(model, self.state.fp8, self._class("base_model"), self.attach_fp8)

    def decoder_layers(self, model) -> list:
        layer_class = self._class("decoder_layer")
        return [layer for layer in model.sublayers(include_self=True) if isinstance(layer, layer_class)]

    def patched_layer_count(self, model) -> int:
        return len(self.decoder_layers(model)) if state.current() is not None else 0
