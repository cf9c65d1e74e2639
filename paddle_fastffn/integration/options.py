"""What parts of the fast path to use, declared once: each field of FastFFNOptions is one option,
with its type, default and help text. The other places that name the options are made from it or
checked against it:
- FastFFNTrainingArguments (integration/training_args.py): one `fast_ffn_<name>` field per option,
  generated from these fields (TRAINING_ARGUMENT_PREFIX, training_argument_fields);
- apply_fast_ffn_to_llama's keywords (paddle_fastffn/__init__.py, which imports nothing Paddle):
  checked against these fields by tests/integration/test_training_args.py;
- docs/usage.md's argument table: checked against the generated fields by tests/integration/test_docs.py;
- scripts/run_finetune.py's arguments (finetune/llm_arguments.py): inherit the TrainingArguments fields.

The defaults are the benchmarked path. Each part applies wherever it can (fused projections need
plain Linear weights built while the fast path is enabled; SwiGLU recompute needs the fused
gate/up projection and a plain Linear down_proj); where it cannot (LoRA, tensor or pipeline
parallel layers, a model built before enabling), the layer keeps PaddleNLP's sub-layers and one
info line says so.
"""

from __future__ import annotations

import re
import typing
from dataclasses import MISSING, asdict, dataclass, field, fields

PRECISIONS = ("bf16", "fp8")
# core/optimizer.py's MOMENT_FORMATS and MASTER_WEIGHT_FORMATS, spelled out: this module imports
# nothing of the optimizer (paddle_fastffn/__init__.py reads it without Paddle).
OPTIMIZER_MOMENTS = ("fp32", "int8")
OPTIMIZER_MASTER_WEIGHTS = ("fp32", "compensated")
FP8_FALLBACKS = ("error", "bf16")
TRAINING_ARGUMENT_PREFIX = "fast_ffn_"  # FastFFNOptions.swiglu is the fast_ffn_swiglu argument


def option(default, help: str, switch: bool = False):
    """One option: its default, the help text every place that lists it shows, and whether it is a
    switch (a part of the fast path that can be turned off, which the run report lists: report.py)."""
    return field(default=default, metadata={"help": help, "switch": switch})


@dataclass(frozen=True)
class FastFFNOptions:
    swiglu: bool = option(True, switch=True, help="Fused SwiGLU in the MLP.")
    rms_norm: bool = option(True, switch=True, help=(
        "Fused RMSNorm, and the attention residual add fused into the post-attention norm."))
    rotary: bool = option(True, switch=True, help="Fused rotary embedding on q and k.")
    attention: bool = option(True, switch=True, help=(
        "Use the device's SDPA kernel (flash attention on GPU) via use_flash_attention."))
    # PaddleNLP fuses unfused checkpoints on load.
    fuse_projections: bool = option(True, switch=True, help=(
        "Build fused qkv_proj and gate_up_fused_proj (one GEMM each) where the weights are plain Linear layers "
        "(not under tensor/pipeline parallel; LoRA gets the stock sub-layers back); PaddleNLP fuses unfused "
        "checkpoints on load."))
    # Saves [tokens, intermediate] per layer.
    swiglu_recompute: bool = option(True, switch=True, help=(
        "Recompute the SwiGLU output in backward instead of storing it (where gate/up are fused and down_proj is "
        "a plain Linear)."))
    # The default: save_pretrained of a model whose projections the fast path fused writes the
    # stock unfused layout (q/k/v_proj, gate_proj/up_proj; config fuse_attention_* as before).
    save_fused_checkpoint: bool = option(False, (
        "Save PaddleNLP's fused layout (qkv_proj, gate_up_fused_proj, fuse_attention_* in config.json) instead "
        "of the stock unfused LLaMA layout that the fast path saves by default."))
    # Through ops.linear_cross_entropy: the LM head GEMM and PaddleNLP's criterion in chunks of
    # tokens. Eval and generation keep stock (they need the logits).
    fused_cross_entropy: bool = option(True, switch=True, help=(
        "Training loss of LlamaForCausalLM as one fused LM head + cross-entropy in chunks of tokens (never the "
        "[tokens, vocab] fp32 logits; PaddleNLP's loss). Needs a plain LM head weight or tied embeddings, not "
        "tensor parallel; the training forward then returns no logits."))
    # fp32 master weights and moments under AMP O2; integration/trainer.py swaps the class.
    fused_optimizer: bool = option(True, switch=True, help=(
        "Build paddle_fastffn.optim.FastAdamW where the Trainer builds paddle.optimizer.AdamW: the same "
        "optimizer and checkpoints, each parameter updated in one pass of a fused kernel, global-norm clipping "
        "folded into it."))
    # FastAdamW's low-memory state (fastffn/optimizer.h); needs fused_optimizer.
    optimizer_moments: str = option("fp32", (
        "FastAdamW's moments: \"fp32\" (Paddle's, 8 bytes a parameter) or \"int8\" (8-bit blockwise-quantised, "
        "bitsandbytes' dynamic maps, one fp32 absmax per 256 elements: 2.03 bytes a parameter; tensors under 4096 "
        "elements keep fp32). Checkpoints keep Paddle's layout (moments dequantised to fp32)."))
    optimizer_master_weights: str = option("fp32", (
        "FastAdamW's master weights of bf16/fp16 parameters under AMP O2: \"fp32\" (Paddle's, 4 bytes a parameter) "
        "or \"compensated\" (a 16-bit Kahan compensation, 2 bytes: the update is applied to weight + compensation, "
        "so steps below the weight's last bit are kept). Checkpoints keep Paddle's master_weights (weight + "
        "compensation in fp32)."))
    # FP8: the MLP as one FP8 FFN (paddle_fastffn.fp8.Fp8FFN, SwiGLU fused with quantising its
    # output) where its fused projections are plain Linear layers, every other linear through
    # paddle_fastffn.fp8.Fp8Linear (plain Linear and LoRA's base GEMM). FP8 is a compute format
    # only. Where FP8 cannot run: an error, or with fp8_fallback="bf16" one warning and the bf16
    # path (integration/fp8_attach.py: resolve_fp8).
    precision: str = option("bf16", (
        "GEMM precision of the decoder layers' linear layers: \"bf16\" (the activation dtype) or \"fp8\" "
        "(per-tensor scaled FP8 GEMMs, the MLP as one FP8 FFN with SwiGLU fused into its quantisation; LoRA "
        "adapters stay bf16 over an FP8 base GEMM; parameters and checkpoints keep their dtypes). Where FP8 "
        "cannot run (no sm_90 GPU and no fast_ffn_fp8_emulate): an error, unless fast_ffn_fp8_fallback=bf16."))
    # Fp8Recipe's fields, with the "fp8_" prefix (Fp8Recipe.from_dict validates them).
    fp8_scaling: str = option("delayed", (
        "FP8 scaling: \"delayed\" (amax history, Transformer Engine's DelayedScaling) or \"current\"."))
    fp8_amax_history_len: int = option(1024, "FP8 delayed scaling: amax history length.")
    fp8_amax_compute_algo: str = option("max", "FP8 delayed scaling: \"max\" or \"most_recent\" over the amax history.")
    fp8_margin: float = option(0.0, "FP8 scale = fp8_max / amax / 2^margin.")
    fp8_first_last_bf16: bool = option(False, (
        "Keep the first and last decoder layers' GEMMs in bf16 under fast_ffn_precision=fp8."))
    fp8_min_gemm_size: int = option(0, "GEMMs with M*N*K below this stay bf16 under fast_ffn_precision=fp8.")
    fp8_delayed_warm_start: bool = option(True, (
        "FP8 delayed scaling: quantise each tensor's first use with its own amax (current scaling) and seed its "
        "amax history with it; false: Transformer Engine's exact behaviour (every scale starts at 1, so the first "
        "steps' e5m2 gradients can underflow to zero)."))
    fp8_saved_gate_up: str = option("fp8", (
        "What the FP8 FFN keeps of its gate_up projection output for backward: \"fp8\" (its own per-tensor "
        "scaled e4m3 copy, 1 byte an element, written by the SwiGLU forward pass) or \"activation\" (the "
        "bf16/fp16 tensor, 2 bytes an element)."))
    fp8_frozen_weights: str = option("fp8", (
        "Frozen weights under fast_ffn_precision=fp8 (LoRA's base projections): \"fp8\" holds each only as the "
        "FP8 copy its forward GEMM reads (1 byte a parameter on the GPU; the 16-bit weight moves to host memory, "
        "where merging, saving and revert read it; backward transposes the copy for its dgrad GEMM), \"fp8_both\" "
        "holds both FP8 copies instead (2 bytes, no transposition) or \"resident\" (the 16-bit weight stays on "
        "the GPU beside both FP8 copies). Same numerics."))
    fp8_weight_copies: str = option("per_use", (
        "Trained weights' FP8 copies under fast_ffn_precision=fp8: \"per_use\" quantises the copy each GEMM "
        "reads when it runs and holds none (FP8 adds no weight memory to bf16's; one more read of each weight per "
        "backward), \"cached\" holds both FP8 copies of every weight until it changes (2 bytes a parameter more; "
        "gradient accumulation quantises each weight once a step). Same numerics."))
    fp8_lm_head: str = option("bf16", (
        "The LM head + loss under fast_ffn_precision=fp8: \"bf16\" (the activation dtype, as Transformer Engine's "
        "and NeMo's FP8 recipes keep it) or \"fp8\" (its three GEMMs in FP8: h and W current-scaled over the "
        "call, the logits' gradient by its bound 1/n, the weight gradient one GEMM over every chunk; needs "
        "fast_ffn_fused_cross_entropy, hidden and vocabulary sizes multiples of 16, else one warning and the "
        "16-bit head)."))
    # Without it (or fp8_fallback), FP8 on CPU is an error.
    fp8_emulate: bool = option(False, (
        "Run fast_ffn_precision=fp8 emulated (FP8 rounding and scaling, fp32 GEMMs; no speed-up) where FP8 GEMMs "
        "cannot run, e.g. on CPU for tests and to check recipes and checkpoints."))
    # Where FP8 can run neither on the GPU nor emulated: stop (the default), or train in bf16 and say
    # so (a warning, the run report, scripts/run_finetune.py's last line and run_summary.json).
    fp8_fallback: str = option("error", (
        "Where fast_ffn_precision=fp8 cannot run (no sm_90 GPU, no fast_ffn_fp8_emulate): \"error\" stops before "
        "any work; \"bf16\" trains in bf16 (fp32 on CPU) and says so in the run's summary."))

    def __post_init__(self):
        if self.precision not in PRECISIONS:
            raise OptionError("precision", f"one of {list(PRECISIONS)}", self.precision)
        if self.optimizer_moments not in OPTIMIZER_MOMENTS:
            raise OptionError("optimizer_moments", f"one of {list(OPTIMIZER_MOMENTS)}", self.optimizer_moments)
        if self.optimizer_master_weights not in OPTIMIZER_MASTER_WEIGHTS:
            raise OptionError("optimizer_master_weights", f"one of {list(OPTIMIZER_MASTER_WEIGHTS)}",
                              self.optimizer_master_weights)
        if not self.fused_optimizer and self.optimizer_state() != {}:
            raise OptionError("fused_optimizer", "true where optimizer_moments or optimizer_master_weights is "
                              "not \"fp32\" (FastAdamW keeps that state)", self.fused_optimizer)
        if self.fp8_fallback not in FP8_FALLBACKS:
            raise OptionError("fp8_fallback", f"one of {list(FP8_FALLBACKS)}", self.fp8_fallback)
        if not isinstance(self.fp8_emulate, bool):
            raise OptionError("fp8_emulate", "true or false", self.fp8_emulate)
        self.fp8_recipe()  # validates the recipe fields even while precision is bf16
        if self.fp8_lm_head == "fp8" and not self.fused_cross_entropy:
            raise OptionError("fp8_lm_head", "\"bf16\" where fused_cross_entropy is off (the FP8 LM head is the fused "
                              "loss's GEMMs)", self.fp8_lm_head)

    def fp8_recipe(self):
        """The Fp8Recipe of the fp8_* fields; a bad value raises OptionError naming the fp8_* option
        (not the recipe's own field)."""
        from ..fp8.recipe import Fp8Recipe

        recipe_fields = {f"fp8_{f.name}" for f in fields(Fp8Recipe)}
        values = {name: value for name, value in asdict(self).items() if name in recipe_fields}
        try:
            return Fp8Recipe.from_dict(values, prefix="fp8_")
        except ValueError as error:
            # core/fp8/recipe.py says "Fp8Recipe.<field> must be <expected>, got <value>".
            found = re.fullmatch(r"Fp8Recipe\.(\w+) must be (.+), got (.*)", str(error))
            if found is None:
                raise
            raise OptionError("fp8_" + found.group(1), found.group(2), found.group(3), got_repr=True) from None

    def optimizer_state(self) -> dict:
        """FastAdamW's keywords for the state options that differ from Paddle's layout."""
        state = {"moments": self.optimizer_moments, "master_weights": self.optimizer_master_weights}
        return {name: value for name, value in state.items() if value != "fp32"}

    def as_dict(self) -> dict:
        return asdict(self)


class OptionError(ValueError):
    """A FastFFNOptions value out of range: names the option as its caller spells it (`fp8_scaling`
    for apply_fast_ffn_to_llama, `fast_ffn_fp8_scaling` for the TrainingArguments: with_prefix)."""

    def __init__(self, option: str, expected: str, got, got_repr: bool = False):
        self.option, self.expected, self.got = option, expected, got if got_repr else repr(got)
        super().__init__(self.message(""))

    def message(self, prefix: str) -> str:
        return f"{prefix}{self.option} must be {self.expected}, got {self.got}"

    def with_prefix(self, prefix: str) -> "OptionError":
        error = OptionError(self.option, self.expected, self.got, got_repr=True)
        error.args = (self.message(prefix),)
        return error


def training_argument_fields() -> list:
    """[(name, type, dataclasses.field)] of the TrainingArguments fields, one per option: the name
    with TRAINING_ARGUMENT_PREFIX, the option's type, default and help (make_dataclass's form)."""
    types = typing.get_type_hints(FastFFNOptions)
    # PdArgumentParser hands a field's metadata to argparse's add_argument: the help only.
    return [(TRAINING_ARGUMENT_PREFIX + f.name, types[f.name],
             field(default=f.default, metadata={"help": f.metadata["help"]})) for f in fields(FastFFNOptions)]


def option_defaults() -> dict:
    """{option name: default}."""
    return {f.name: f.default for f in fields(FastFFNOptions) if f.default is not MISSING}


# The parts of the fast path that can be switched off, in declaration order.
SWITCHES = tuple(f.name for f in fields(FastFFNOptions) if f.metadata["switch"])
