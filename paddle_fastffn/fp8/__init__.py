"""FP8 training, per-tensor scaled (Transformer Engine's current and delayed scaling recipes).

formats: e4m3/e5m2 quantisation with the CUDA kernels' byte contract; recipe: Fp8Recipe and the
ScalingState per tensor role; weight_cache: one weight quantisation per optimizer step; linear:
fp8_linear (emulated: fp32 GEMMs on FP8 values), its reference and the Fp8Linear/LoRA helper;
cuda: fp8_linear_cuda, the cuBLASLt FP8 GEMMs on Hopper that Fp8Linear picks where they can run."""

from .cuda import fp8_linear_cuda
from .formats import FP8_DTYPES, FP8_MAX, Quantized, dequantize, quantize
from .linear import Fp8Linear, fp8_linear, fp8_linear_ref
from .recipe import Fp8Recipe, LinearScalingStates, ScalingState, scale_from_amax
from .weight_cache import WeightCache

__all__ = ["FP8_DTYPES", "FP8_MAX", "Fp8Linear", "Fp8Recipe", "LinearScalingStates", "Quantized",
           "ScalingState", "WeightCache", "dequantize", "fp8_linear", "fp8_linear_cuda", "fp8_linear_ref", "quantize",
           "scale_from_amax"]
