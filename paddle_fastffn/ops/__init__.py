"""Fused operators: each has a compiled kernel path (CPU C++; CUDA where Paddle has CUDA), autograd,
and a pure-Paddle ``*_ref`` reference used by tests and on devices the kernels do not cover."""

from ._loader import FastFFNBuildError, ensure_loaded
from .linear_cross_entropy import linear_cross_entropy, linear_cross_entropy_ref
from .varlen_attention import PackedSegments, packed_attention, packed_attention_ref
from .rms_norm import fused_add_rms_norm, fused_add_rms_norm_ref, rms_norm, rms_norm_ref
from .rotary import (check_rotary_positions, qkv_rotary, qkv_rotary_ref, rotary_embedding,
                     rotary_embedding_ref)
from .swiglu import swiglu, swiglu_down_proj, swiglu_ref

__all__ = [
    "FastFFNBuildError", "ensure_loaded", "fused_add_rms_norm", "fused_add_rms_norm_ref",
    "linear_cross_entropy", "linear_cross_entropy_ref", "PackedSegments", "packed_attention",
    "packed_attention_ref",
    "rms_norm", "rms_norm_ref", "check_rotary_positions", "qkv_rotary", "qkv_rotary_ref",
    "rotary_embedding", "rotary_embedding_ref", "swiglu",
    "swiglu_down_proj", "swiglu_ref",
]
