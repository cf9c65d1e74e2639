"""What the fast path tells the user, once per reason, for every model family: a fallback warning
(stock math kept where a fused kernel cannot run: an error under PADDLE_FASTFFN_STRICT, as an op's
fallback is), an info line (a part that does not apply by design) and an FP8 configuration warning.
The remembered reasons are cleared when the fast path is disabled (registry.disable), so enabling it
again says everything again."""

from __future__ import annotations

import warnings

from ..ops._fallback import raise_if_strict

_WARNED: set = set()
_INFORMED: set = set()
_FP8_WARNED: set = set()


def warn_once(key: str, message: str) -> None:
    """Layers the fused path does not cover keep their stock math; say so once per reason (an
    error in strict mode, as a fallback of an op is)."""
    raise_if_strict(f"paddle_fastffn: {message}")
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(f"paddle_fastffn: {message}", RuntimeWarning, stacklevel=3)


def info_once(key: str, message: str, covers: tuple = ()) -> None:
    """Where a part of the fast path does not apply by design (LoRA, tensor parallel, a model built
    before enabling), the layer keeps PaddleNLP's sub-layers: one info line, not a fallback
    warning. `covers`: the per-forward reasons this line already explains."""
    if key not in _INFORMED:
        from .library import logger

        logger().info(f"paddle_fastffn: {message}")
    _INFORMED.add(key)
    _INFORMED.update(covers)


def fp8_warn_once(key: str, message: str) -> None:
    """A configuration FP8 cannot honour here: one UserWarning per reason (not a kernel fallback,
    so not an error under PADDLE_FASTFFN_STRICT)."""
    if key not in _FP8_WARNED:
        _FP8_WARNED.add(key)
        warnings.warn(f"paddle_fastffn: {message}", UserWarning, stacklevel=4)


def forget() -> None:
    """Every reason is said again after this (registry.disable: a new enable may change them)."""
    _WARNED.clear()
    _INFORMED.clear()
    _FP8_WARNED.clear()
