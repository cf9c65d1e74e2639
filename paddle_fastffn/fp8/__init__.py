"""FP8 training, per-tensor scaled (Transformer Engine's current and delayed scaling recipes).

formats: e4m3/e5m2 quantisation with the CUDA kernels' byte contract; recipe: Fp8Recipe and the
ScalingState per tensor role; weight_cache: one weight quantisation per weight version (weights_updated, track_optimizer); linear:
fp8_linear (emulated: fp32 GEMMs on FP8 values), its reference and the Fp8Linear/LoRA helper;
cuda: fp8_linear_cuda, the cuBLASLt FP8 GEMMs on Hopper that Fp8Linear picks where they can run;
ffn: the FP8 FFN (SwiGLU MLP with SwiGLU fused into its quantisation), fp8_ffn (emulated),
fp8_ffn_cuda, fp8_ffn_ref and Fp8FFN, the composition the GPU benchmarks time."""

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
