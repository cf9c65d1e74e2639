"""FP8 recipes and scaling states for Paddle: the framework-neutral ones of
paddle_fastffn/core/fp8 (recipe.py: Fp8Recipe and the scale formulas; scaling.py: the per-tensor
state machine), whose tensors are the Paddle emulated backend's (emulated.py, registered on import),
and scale_from_amax, the formula in Paddle ops."""

from __future__ import annotations

from ..core.fp8.recipe import AMAX_COMPUTE_ALGOS, SAVED_GATE_UP, SCALING_MODES, Fp8Recipe
from ..core.fp8.scaling import FfnScalingStates, LinearScalingStates, ScalingState
from .emulated import scale_from_amax

__all__ = ["AMAX_COMPUTE_ALGOS", "SAVED_GATE_UP", "SCALING_MODES", "FfnScalingStates", "Fp8Recipe",
           "LinearScalingStates", "ScalingState", "scale_from_amax"]
