"""The `use_fast_ffn` flag and the `fast_ffn_*` options as fields of the installed library's
training arguments (library.py: PaddleNLP's or PaddleFormers' TrainingArguments).

Parsed as the library's own scripts parse them (PdArgumentParser: a JSON or YAML file, command-line
flags overriding it). With use_fast_ffn=True the fast path is enabled as the arguments are built,
so the model constructed afterwards (from_pretrained / from_config / direct) is patched at
construction.

- FastFFNTrainingArguments: the library's TrainingArguments with the fields;
- with_fast_ffn_fields(base): any TrainingArguments subclass with them, e.g. PaddleFormers'
  FinetuningArguments, the class its `paddleformers.cli.launcher train x.yaml` parses
  (plugin.py puts it into the launcher's parser).
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass, field, fields, make_dataclass

from .options import TRAINING_ARGUMENT_PREFIX, FastFFNOptions, OptionError, training_argument_fields
from .registry import enable

USE_FAST_FFN_HELP = ("Patch LLaMA-style decoder layers with paddle_fastffn's fused SwiGLU, RMSNorm, rotary and "
                     "attention paths when the model is built.")


class _FastFFNArguments:
    """The methods of every class with_fast_ffn_fields makes (its fields come from options.py)."""

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
            from .library import logger

            logger().info(f"paddle_fastffn: {writer} writes the model's own parameters: projections stay unfused "
                          f"so checkpoints keep the stock layout (fast_ffn_save_fused_checkpoint=true fuses them and "
                          f"saves the fused layout)")
        enable(options)
        import paddle

        if (self.bf16 or self.fp16) and not paddle.is_compiled_with_cuda():
            warnings.warn("paddle_fastffn: this Paddle build has no GPU, and Paddle's CPU AMP is a no-op: "
                          "training runs in float32 (the fused kernels support bf16/fp16 where AMP runs).",
                          RuntimeWarning, stacklevel=2)


def has_fast_ffn_fields(cls) -> bool:
    return any(f.name == "use_fast_ffn" for f in fields(cls))


@functools.cache
def with_fast_ffn_fields(base: type, name: str | None = None) -> type:
    """`base` (a TrainingArguments dataclass) plus `use_fast_ffn` and one `fast_ffn_<option>` field per
    FastFFNOptions field (its type, default and help: options.py declares them once); made once
    per base (a base that has them already is returned as it is). Parsing it with use_fast_ffn=True
    enables the fast path."""
    if has_fast_ffn_fields(base):
        return base
    fields_class = make_dataclass(f"_FastFFNFieldsOf{base.__name__}", [
        ("use_fast_ffn", bool, field(default=False, metadata={"help": USE_FAST_FFN_HELP})),
        *training_argument_fields()], bases=(base,))
    fields_class.__module__ = __name__
    name = name or f"FastFFN{base.__name__}"
    cls = type(name, (_FastFFNArguments, fields_class), {
        "__module__": __name__, "__qualname__": name,
        "__doc__": f"{base.__module__}.{base.__name__} with `use_fast_ffn` and the `fast_ffn_*` options."})
    return dataclass(cls)


def __getattr__(name):
    # The installed library's TrainingArguments is imported on first use (library.py picks it).
    if name == "FastFFNTrainingArguments":
        from .library import module

        return with_fast_ffn_fields(module("trainer").TrainingArguments, "FastFFNTrainingArguments")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
