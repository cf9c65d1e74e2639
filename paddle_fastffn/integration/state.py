"""What the fast path holds while the process runs, in one place:

- the options it runs with: registry.enable sets them (every family's construction hook and
  patched forwards read them), registry.disable clears them; None while the fast path is off;
- one FamilyState per model family (for_family): what that family's patch saved and holds. The
  registry reaches each as family_state(model_type); the family's own forwards read theirs here
  (they cannot import the registry, which imports them);
- the loader of Hugging Face Hub folders that the layer above the patch (finetune/checkpoint.py)
  offers: the patch calls it and never imports that layer."""

from __future__ import annotations

from dataclasses import dataclass, field

from .options import FastFFNOptions

_CURRENT: FastFFNOptions | None = None


def current() -> FastFFNOptions | None:
    return _CURRENT


def set_current(options: FastFFNOptions | None) -> None:
    global _CURRENT
    if options is not None and not isinstance(options, FastFFNOptions):
        raise TypeError(f"paddle_fastffn: options must be a FastFFNOptions or None, got {type(options).__name__}")
    _CURRENT = options


@dataclass
class FamilyState:
    """A family's patch state: `originals`, what its patched attributes held before the first
    apply() (kept until the process ends: revert restores from them); `hooks`, the originals of
    the install-once hooks (empty until installed); `fp8`, the Fp8Recipe while FP8 GEMMs run;
    `applied`, the options the class-level patch was last applied with (None while reverted), so
    that applying the same options again changes nothing; `applications`, how often the
    class-level patch was actually applied (the run log and the patch-once test read it)."""

    originals: dict = field(default_factory=dict)
    hooks: dict = field(default_factory=dict)
    fp8: object = None
    applied: FastFFNOptions | None = None
    applications: int = 0

    def forget(self) -> None:
        """After revert: nothing applied, FP8 off (originals and hooks stay)."""
        self.fp8 = None
        self.applied = None


_FAMILIES: dict = {}


def for_family(name: str) -> FamilyState:
    """The FamilyState of the family named `name` (created on first use)."""
    return _FAMILIES.setdefault(name, FamilyState())


# The Hub-folder loader: (cls, path, kwargs) -> a model, or None where it does not apply.
_HUB_LOADER: dict = {"load": None}


def set_hub_loader(load) -> None:
    _HUB_LOADER["load"] = load


def hub_loader():
    return _HUB_LOADER["load"]
