"""Model patches (one file per family, a registry by model_type) and the TrainingArguments flag."""

from .options import FastFFNOptions
from .registry import apply_to_model, disable, enable, enabled_options, supported_model_types

__all__ = ["FastFFNOptions", "apply_to_model", "disable", "enable", "enabled_options",
           "supported_model_types"]
