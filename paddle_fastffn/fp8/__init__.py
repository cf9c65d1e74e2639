"""FP8 training, per-tensor scaled (Transformer Engine's current and delayed scaling recipes), for
Paddle. The recipe, the scaling state machine, the weight cache and the FP8 linear's and FFN's
forward/backward are written once in paddle_fastffn/core/fp8 (the torch harness runs the same);
this package is their Paddle side:

emulated: the pure-Paddle FP8 backend (CPU CI; registered as the scaling states' storage); cuda:
the backend over the compiled ops (cuBLASLt FP8 GEMMs, fused SwiGLU + FP8 kernels on Hopper) and
fp8_linear_cuda; formats: e4m3/e5m2 quantisation with the CUDA kernels' byte contract; recipe:
Fp8Recipe and the ScalingStates; weight_cache: WeightCache (one quantisation per weight version)
and the explicit freshness calls weights_updated and track_optimizer; linear: fp8_linear
(emulated), its reference and the Fp8Linear/LoRA helper; ffn: fp8_ffn (emulated), fp8_ffn_cuda,
fp8_ffn_ref and Fp8FFN; recompute: fp8_recompute (delayed scaling under activation recompute)."""

from .cuda import fp8_linear_cuda
from .ffn import Fp8FFN, fp8_ffn, fp8_ffn_cuda, fp8_ffn_ref
from .formats import FP8_DTYPES, FP8_MAX, Quantized, dequantize, quantize
from .linear import Fp8Linear, fp8_linear, fp8_linear_ref
from .recipe import FfnScalingStates, Fp8Recipe, LinearScalingStates, ScalingState, scale_from_amax
from .weight_cache import WeightCache, track_optimizer, weights_updated

__all__ = ["FP8_DTYPES", "FP8_MAX", "FfnScalingStates", "Fp8FFN", "Fp8Linear", "Fp8Recipe", "LinearScalingStates",
           "Quantized", "ScalingState", "WeightCache", "dequantize", "fp8_ffn", "fp8_ffn_cuda", "fp8_ffn_ref",
           "fp8_linear", "fp8_linear_cuda", "fp8_linear_ref", "quantize", "scale_from_amax", "track_optimizer",
           "weights_updated"]
