"""The FP8 ops' autograd: ops/_autograd.py's one PyLayer adapter, over the emulated or the CUDA
FP8 backend."""

from __future__ import annotations

from ..ops import _autograd


def pylayer(op, backend):
    """ops/_autograd.py's one PyLayer adapter over `backend`, named for it (two backends run FP8)."""
    return _autograd.pylayer(op, backend, name=f"{op.__name__}_{backend.name.replace('-', '_')}")
