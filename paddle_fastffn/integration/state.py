"""The options the fast path runs with: one store for the process. registry.enable sets it (every
family's construction hook and patched forwards read it), registry.disable clears it; None while
the fast path is off."""

from __future__ import annotations

from .options import FastFFNOptions

_CURRENT: FastFFNOptions | None = None


def current() -> FastFFNOptions | None:
    return _CURRENT


def set_current(options: FastFFNOptions | None) -> None:
    global _CURRENT
    if options is not None and not isinstance(options, FastFFNOptions):
        raise TypeError(f"paddle_fastffn: options must be a FastFFNOptions or None, got {type(options).__name__}")
    _CURRENT = options
