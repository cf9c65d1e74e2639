"""Optimizers whose update runs as one compiled pass per parameter, with Paddle's semantics and
state (drop-in replacements: checkpoints move between them and Paddle's own optimizers)."""

from .adamw import FastAdamW, adamw_ref, adamw_update_, global_norm_clip_coefficient

__all__ = ["FastAdamW", "adamw_ref", "adamw_update_", "global_norm_clip_coefficient"]
