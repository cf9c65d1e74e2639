"""One warning per op when a tensor lives on a device the compiled kernels do not cover, and the
strict mode in which such a fallback is an error (the test suite runs strict, so a suite in which
every op silently fell back to its *_ref path would fail, not pass)."""

from __future__ import annotations

import os
import warnings

STRICT_ENV = "PADDLE_FASTFFN_STRICT"
_warned: set[str] = set()


class UnrequestedFallbackError(RuntimeError):
    """A fused path fell back to reference math while PADDLE_FASTFFN_STRICT=1."""


def raise_if_strict(message: str) -> None:
    if os.environ.get(STRICT_ENV) == "1":
        raise UnrequestedFallbackError(f"{message} ({STRICT_ENV}=1 makes every fallback an error)")


def warn_fallback(op: str, place) -> None:
    message = (f"{op}: no compiled kernel for {place}; using the pure-Paddle reference path "
               f"(correct, not fused)")
    raise_if_strict(message)
    if op in _warned:
        return
    _warned.add(op)
    warnings.warn(message, RuntimeWarning, stacklevel=3)
