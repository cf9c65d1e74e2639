"""FastFFNTrainingArguments: PaddleNLP's TrainingArguments plus the `use_fast_ffn` flag.

Parsed like PaddleNLP's own scripts do (PdArgumentParser: a JSON file, command-line flags
overriding it). With use_fast_ffn=True the fast path is enabled as the arguments are built, so
the model constructed afterwards (from_pretrained / from_config / direct) is patched at
construction.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field, make_dataclass

from paddlenlp.trainer import TrainingArguments

from .options import TRAINING_ARGUMENT_PREFIX, FastFFNOptions, OptionError, training_argument_fields
from .registry import enable

# PaddleNLP's TrainingArguments, `use_fast_ffn`, and one `fast_ffn_<option>` field per FastFFNOptions
# field (its type, default and help: options.py declares them once).
_FastFFNFields = make_dataclass("_FastFFNFields", [
    ("use_fast_ffn", bool, field(default=False, metadata={
        "help": "Patch LLaMA-style decoder layers with paddle_fastffn's fused SwiGLU, RMSNorm, rotary and "
                "attention paths when the model is built."})),
    *training_argument_fields()], bases=(TrainingArguments,))
_FastFFNFields.__module__ = __name__


@dataclass
class FastFFNTrainingArguments(_FastFFNFields):
    """PaddleNLP's TrainingArguments with `use_fast_ffn` and the `fast_ffn_*` options."""

    def fast_ffn_options(self) -> FastFFNOptions:
        """The FastFFNOptions of the fast_ffn_* fields (fused projections off where the checkpoint
        writer would save them fused: _checkpoint_writer_without_split)."""
        values = {name[len(TRAINING_ARGUMENT_PREFIX):]: getattr(self, name)
                  for name, _type, _field in training_argument_fields()}
        values["fuse_projections"] = self.fast_ffn_fuse_projections and not self._checkpoint_writer_without_split()
        if isinstance(values["fp8_margin"], int) and not isinstance(values["fp8_margin"], bool):
            values["fp8_margin"] = float(values["fp8_margin"])  # a JSON 0 parses as int
        try:
            return FastFFNOptions(**values)
        except OptionError as error:  # named as the user wrote it: fast_ffn_fp8_scaling, not fp8_scaling
            raise error.with_prefix(TRAINING_ARGUMENT_PREFIX) from None

    def _checkpoint_writer_without_split(self) -> str | None:
        """The option whose checkpoint writer saves model.state_dict() as it is (no save_pretrained
        split): fused projections would leave a fused checkpoint, so they stay off unless
        fast_ffn_save_fused_checkpoint asks for the fused layout."""
        if self.fast_ffn_save_fused_checkpoint:
            return None
        if getattr(self, "unified_checkpoint", False):
            return "unified_checkpoint"
        if getattr(self, "save_sharded_model", False):
            return "save_sharded_model (sharding stage 1)"
        return None

    def __post_init__(self):
        super().__post_init__()
        options = self.fast_ffn_options()  # validates fast_ffn_precision and the FP8 recipe fields
        if not self.use_fast_ffn:
            return
        writer = self._checkpoint_writer_without_split() if self.fast_ffn_fuse_projections else None
        if writer:
            from paddlenlp.utils.log import logger

            logger.info(f"paddle_fastffn: {writer} writes the model's own parameters: projections stay unfused "
                        f"so checkpoints keep the stock layout (fast_ffn_save_fused_checkpoint=true fuses them and "
                        f"saves PaddleNLP's fused layout)")
        enable(options)
        import paddle

        if (self.bf16 or self.fp16) and not paddle.is_compiled_with_cuda():
            warnings.warn("paddle_fastffn: this Paddle build has no GPU, and Paddle's CPU AMP is a no-op: "
                          "training runs in float32 (the fused kernels support bf16/fp16 where AMP runs).",
                          RuntimeWarning, stacklevel=2)
