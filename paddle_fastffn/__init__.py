"""paddle_fastffn: fused, mixed-precision FFN and attention paths for LLaMA-style models in
PaddleNLP. Public API only; see README.md."""

from . import ops

__version__ = "0.1.0"
__all__ = ["ops", "__version__"]
