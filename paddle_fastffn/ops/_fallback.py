"""One warning per op when a tensor lives on a device the compiled kernels do not cover."""

from __future__ import annotations

import warnings

_warned: set[str] = set()


def warn_fallback(op: str, place) -> None:
    if op in _warned:
        return
    _warned.add(op)
    warnings.warn(f"{op}: no compiled kernel for {place}; using the pure-Paddle reference path "
                  f"(correct, not fused)", RuntimeWarning, stacklevel=3)
