"""Attaching FP8 compute to a model's layers, for any decoder family (llama.py, mixtral.py and
paddleformers_llama.py use it): which recipe runs here (resolve_fp8), a family's FP8 switch (switch_fp8: its recipe and the FP8
phases of PaddleNLP's recompute) and checkpoint layers, the FP8 FFN hung off an MLP, an Fp8Linear
hung off each other target linear (nested owners by dotted path: Mixtral's experts), and detaching
them all.

Both objects (`_fast_ffn_fp8` in the layer's __dict__) hold the scaling states and weight caches,
so parameters, their dtypes and state_dict names stay stock (FP8 is a compute format only). Each
attached Linear's own forward runs its Fp8Linear (an instance attribute `forward` shadows the
class's): no Linear class is patched, so other models' linears never pass through the plugin, and
detach_all_fp8_linears undoes every attachment. The recipe's first/last-layer rule keeps those
decoder layers stock; its min_gemm_size applies per GEMM and the 16-alignment rule per weight (a
misaligned one: one warning, bf16)."""

from __future__ import annotations

import weakref

import paddle
from paddle import nn

from .messages import fp8_warn_once

# The linears whose own forward runs their Fp8Linear (detach_all_fp8_linears detaches them).
FP8_LINEARS: "weakref.WeakSet" = weakref.WeakSet()
ATTRIBUTE = "_fast_ffn_fp8"


class Fp8UnavailableError(ValueError):
    """fast_ffn_precision=fp8 cannot run on this machine and no fallback was asked for."""


# Why the last resolve_fp8 fell back to bf16 (fp8_fallback="bf16"), or None: for the run's summary.
_FALLBACK: dict = {"reason": None}
_EMULATE_HINT = "fast_ffn_fp8_emulate=true runs an emulated FP8 path (no speed-up) for tests and recipe checks"


def _cuda_unavailable():
    """(key, why) where the CUDA FP8 backend cannot run here (fp8/cuda.py), None where it can."""
    from ..fp8 import cuda as fp8_cuda

    compiled = paddle.is_compiled_with_cuda()
    capability = fp8_cuda.device_capability() if compiled else None
    ops_error = fp8_cuda.ops_error() if capability == fp8_cuda.SUPPORTED_CAPABILITY else None
    return fp8_cuda.unavailable_reason(compiled, capability, ops_error)


def _unavailable_message(key: str, why: str) -> str:
    if key == "no_cuda":
        return "fast_ffn_precision=fp8 needs an NVIDIA Hopper GPU (sm_90) and this Paddle build has no GPU"
    if key == "arch":
        return f"fast_ffn_precision=fp8 needs an NVIDIA Hopper GPU (sm_90); {why}"
    return f"fast_ffn_precision=fp8: {why}"  # a CUDA Paddle on sm_90 whose operator library cannot be used


def fp8_unavailable(options, cuda_reason=False):
    """(key, message) where fast_ffn_precision=fp8 can run neither on the GPU nor emulated, else None
    (FP8 runs, or was not asked for). cuda_reason: _cuda_unavailable()'s answer, if known."""
    if options.precision != "fp8":
        return None
    reason = _cuda_unavailable() if cuda_reason is False else cuda_reason
    if reason is None or options.fp8_emulate:
        return None
    key, why = reason
    return key, _unavailable_message(key, why)


def check_fp8_runs(options, cuda_reason=False) -> None:
    """Raise Fp8UnavailableError (one line: what is missing, the three ways on) where FP8 cannot run
    here and fp8_fallback is "error"; called before the fast path is enabled, so nothing has run."""
    unavailable = fp8_unavailable(options, cuda_reason)
    if unavailable is not None and options.fp8_fallback == "error":
        raise Fp8UnavailableError(f"{unavailable[1]}: set fast_ffn_fp8_emulate=true for emulated FP8 (no speed-up), "
                                  f"fast_ffn_fp8_fallback=bf16 to train in bf16 instead, or "
                                  f"fast_ffn_precision=bf16")


def fp8_fallback_reason() -> str | None:
    """Why this run trains in bf16 although fast_ffn_precision=fp8 (fast_ffn_fp8_fallback=bf16), or None."""
    return _FALLBACK["reason"]


def resolve_fp8(options, info_once):
    """The Fp8Recipe to run with, or None (bf16). FP8 runs on the GPU where the CUDA backend can
    (sm_90, a CUDA Paddle, the operators built: fp8/cuda.py), emulated elsewhere with fp8_emulate;
    otherwise it is an error (Fp8UnavailableError), or with fp8_fallback="bf16" one warning and None
    (fp8_fallback_reason says why). info_once(key, message): the integration's one-line info log."""
    _FALLBACK["reason"] = None
    if options.precision != "fp8":
        return None
    recipe = options.fp8_recipe()
    reason = _cuda_unavailable()
    if reason is None:
        info_once("fp8_cuda", "fast_ffn_precision=fp8 runs cuBLASLt FP8 GEMMs on this sm_90 GPU (per-tensor "
                              f"{recipe.scaling} scaling, e4m3 forward, e5m2 gradients)")
        return recipe
    if options.fp8_emulate:
        info_once("fp8_emulate", "fast_ffn_precision=fp8 runs emulated (fast_ffn_fp8_emulate): FP8 scaling and "
                                 "e4m3/e5m2 rounding with fp32 GEMMs, FP8 numerics without its speed-up")
        return recipe
    check_fp8_runs(options, reason)
    key, message = fp8_unavailable(options, reason)
    trains_in = "bf16/fp32" if key == "no_cuda" else "bf16"  # Paddle's CPU AMP is a no-op
    _FALLBACK["reason"] = f"{message}: training in {trains_in} (fast_ffn_fp8_fallback=bf16)"
    warn_key = {"no_cuda": "fp8_cpu", "arch": "fp8_arch"}.get(key, "fp8_unwired")
    fp8_warn_once(warn_key, f"{_FALLBACK['reason']}; {_EMULATE_HINT}")
    return None


def lora_linear_class():
    from .library import lora_linear_class

    return lora_linear_class()


def fp8_of(layer):
    """The Fp8Linear or Fp8FFN attached to `layer`, or None."""
    return None if layer is None else layer.__dict__.get(ATTRIBUTE)


def attach_fp8_ffn(mlp, gate_up, down, recipe, why_not: str | None, info_once) -> bool:
    """Attach the FP8 FFN over `mlp`'s fused gate/up and down projections where it applies
    (why_not None); True when the MLP is handled as one (FFN attached, or kept bf16 because
    misaligned), False for the per-linear path."""
    from ..fp8.ffn import Fp8FFN, ffn_widths
    from ..fp8.linear import FP8_ALIGNMENT

    if mlp is None:
        return False
    if why_not is not None:
        mlp.__dict__.pop(ATTRIBUTE, None)
        info_once(f"fp8_mlp:{why_not}", f"fast_ffn_precision=fp8: {why_not}: their linears run Fp8Linear each, "
                                        f"SwiGLU in 16 bits between (the FP8 FFN needs the fused gate/up and the "
                                        f"down projection as plain Linear layers)")
        return False
    existing = fp8_of(mlp)
    if existing is not None and existing.recipe == recipe and existing.gate_up is gate_up and existing.down is down:
        return True
    mlp.__dict__.pop(ATTRIBUTE, None)
    hidden, inter = ffn_widths(type(mlp).__name__, gate_up.weight, down.weight)
    if hidden % FP8_ALIGNMENT or inter % FP8_ALIGNMENT:
        fp8_warn_once(f"fp8_align_ffn:{hidden}x{inter}",
                      f"fast_ffn_precision=fp8: the MLP's hidden size {hidden} and intermediate size {inter} are not "
                      f"both multiples of {FP8_ALIGNMENT} (the FP8 GEMM's alignment): those MLPs stay in bf16")
        return True
    info_once("fp8_ffn", "fast_ffn_precision=fp8: MLPs with plain fused gate/up and down projections run the "
                         "FP8 FFN (gate_up GEMM -> SwiGLU fused with FP8 quantisation -> down GEMM, SwiGLU "
                         "recomputed in backward), the composition of the GPU benchmarks")
    mlp.__dict__[ATTRIBUTE] = Fp8FFN(gate_up, down, recipe)
    return True


def _sub_layer(layer, path: str):
    """The sub-layer at dotted `path` under `layer` ("self_attn", "block_sparse_moe.experts.3"), or None."""
    for name in path.split("."):
        layer = layer._sub_layers.get(name) if layer is not None else None
    return layer


def attach_fp8(decoder_layers, recipe, targets, attach_ffn, info_once, mlp_name: str = "mlp") -> int:
    """Give each of `decoder_layers` its FP8 objects (kept across calls while the recipe is the
    same): attach_ffn(mlp, recipe) -> bool (attach_fp8_ffn with the family's projections) for the
    MLP, and an Fp8Linear for each other target linear, `targets` being ((owner sub-layer path,
    (linear names...)), ...), a path dotted where the owner is nested (a mixture-of-experts
    block's "block_sparse_moe.experts.0"); returns how many linears compute in FP8 (an FFN counts
    its two)."""
    from ..fp8.linear import FP8_ALIGNMENT, Fp8Linear

    lora_class = lora_linear_class()
    layers = list(decoder_layers)
    count = 0
    for index, layer in enumerate(layers):
        in_fp8 = recipe.layer_uses_fp8(index, len(layers))
        mlp = getattr(layer, mlp_name, None)
        if not in_fp8 and mlp is not None:
            mlp.__dict__.pop(ATTRIBUTE, None)
        ffn = in_fp8 and attach_ffn(mlp, recipe)
        count += 2 if ffn and fp8_of(mlp) is not None else 0
        for owner_name, names in targets:
            owner = _sub_layer(layer, owner_name)
            for name in names:
                linear = owner._sub_layers.get(name) if owner is not None else None
                if linear is None:
                    continue
                existing = fp8_of(linear)
                if not in_fp8 or (ffn and owner is mlp):  # stock, or the MLP's FP8 FFN computes it
                    detach_fp8_linear(linear)
                    continue
                if existing is not None and existing.recipe == recipe and existing.linear is linear:
                    count += 1
                    continue
                detach_fp8_linear(linear)
                if type(linear) is not nn.Linear and type(linear) is not lora_class:
                    info_once(f"fp8_layer:{type(linear).__name__}",
                              f"fast_ffn_precision=fp8: {type(linear).__name__} layers (tensor parallel or other "
                              f"non-plain linears) keep their stock GEMMs; FP8 covers plain Linear and LoRALinear")
                    continue
                in_features, out_features = linear.weight.shape
                if in_features % FP8_ALIGNMENT or out_features % FP8_ALIGNMENT:
                    fp8_warn_once(f"fp8_align:{in_features}x{out_features}",
                                  f"fast_ffn_precision=fp8: weight [{in_features}, {out_features}] is not a multiple "
                                  f"of {FP8_ALIGNMENT} in both dimensions (the FP8 GEMM's alignment): those layers "
                                  f"stay in bf16")
                    continue
                attach_fp8_linear(linear, Fp8Linear(linear, recipe, layer_index=index, num_layers=len(layers)))
                count += 1
    return count


def checkpoint_layers(model, recipe, base_model_class, attach) -> tuple:
    """A family's fp8_checkpoint_layers: (recipe, fp8_layers(model)) with attach(base model,
    recipe) run first on each `base_model_class` sub-layer (a resume restores the scaling states
    before the first forward attaches them); (None, {}) while FP8 is off."""
    if recipe is None:
        return None, {}
    for layer in model.sublayers(include_self=True):
        if isinstance(layer, base_model_class):
            attach(layer, recipe)
    return recipe, fp8_layers(model)


def switch_fp8(family_state, modeling, recipe) -> None:
    """Turn a family's FP8 GEMMs on (`recipe`) or off (None): its FamilyState's recipe, which its
    base-model forward attaches the FP8 objects by, and its modeling module's PaddleNLP `recompute`
    (layer and attention recompute) wrapped by fp8/recompute.py while on, so that the replay reuses
    the forward's FP8 scales; off, every attached linear is detached and `recompute` restored."""
    family_state.originals.setdefault("recompute", modeling.recompute)
    family_state.fp8 = recipe
    if recipe is None:
        detach_all_fp8_linears()
        modeling.recompute = family_state.originals["recompute"]
        return
    from ..fp8.recompute import fp8_recompute

    modeling.recompute = fp8_recompute(family_state.originals["recompute"])


def fp8_layers(model) -> dict:
    """{sub-layer name: Fp8Linear or Fp8FFN} of what computes in FP8 in `model`: linears, and MLPs
    running the FP8 FFN (tests, logs, checkpoints)."""
    return {name: fp8_of(layer) for name, layer in model.named_sublayers() if fp8_of(layer) is not None}


def _before_merge(fp8, linear, method: str):
    """LoRALinear's own train()/eval(), after putting a base weight held only in FP8 back on the
    device when the call merges or unmerges the adapters into it (stock's merge_weights), so that
    stock computes the merge there; the next forward quantises the new weight."""
    def call():
        if linear.merge_weights and linear.merged == (method == "train"):
            fp8.restore_weight()
        return getattr(type(linear), method)(linear)
    return call


def _restoring(fp8, linear, method: str):
    """PaddleFormers' LoRALinear.merge()/unmerge() (stock's set_value of the base weight plus or minus
    the adapters), after putting a base weight held only in FP8 back on the device, so that stock
    computes the merge there; the next forward quantises the new weight."""
    def call():
        fp8.restore_weight()
        return getattr(type(linear), method)(linear)
    return call


# The instance attributes attach_fp8_linear may set (detach_fp8_linear removes them).
_ATTACHED = ("forward", "train", "eval", "merge", "unmerge")


def attach_fp8_linear(linear, fp8) -> None:
    linear.__dict__[ATTRIBUTE] = fp8
    linear.__dict__["forward"] = fp8  # Fp8Linear(input): Linear.forward's and LoRALinear.forward's signature
    if getattr(linear, "merge_weights", False):  # PaddleNLP's LoRALinear merges in train()/eval()
        for method in ("train", "eval"):
            linear.__dict__[method] = _before_merge(fp8, linear, method)
    for method in ("merge", "unmerge"):  # PaddleFormers' LoRALinear merges in merge()/unmerge()
        if callable(getattr(type(linear), method, None)):
            linear.__dict__[method] = _restoring(fp8, linear, method)
    FP8_LINEARS.add(linear)


def detach_fp8_linear(linear) -> None:
    fp8 = linear.__dict__.pop(ATTRIBUTE, None)
    if fp8 is not None and hasattr(fp8, "restore_weight"):
        fp8.restore_weight()
    for name in _ATTACHED:
        linear.__dict__.pop(name, None)
    FP8_LINEARS.discard(linear)


def detach_all_fp8_linears() -> None:
    for linear in list(FP8_LINEARS):
        detach_fp8_linear(linear)
