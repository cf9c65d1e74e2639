"""FP8 linear layers: y = x @ W (+ b) with both GEMM operands quantised per tensor, and the
backward's two GEMMs on the same quantised tensors:

    forward  y  = q(x) @ q(W)             x, W in the forward format (e4m3)
    dgrad    dx = q(dy) @ q(W)^T          dy in the backward format (e5m2), W's cached copy
    wgrad    dW = q(x)^T @ q(dy)          x kept in FP8 from the forward (1 byte per element)
    dbias    db = sum over tokens of dy   unquantised, as Transformer Engine does

The orchestration is core/fp8/linear.py's (Fp8LinearOp), shared with the CUDA path and the torch
harness. fp8_linear is the emulated path: the GEMMs run in fp32 on the dequantised values (exact: every FP8
value and every product of two is exact in fp32), so it has FP8 training's numerics without its
speed. It runs wherever Paddle runs (CPU CI included). On a Hopper GPU (sm_90) with a CUDA Paddle,
Fp8Linear runs the same math with cuBLASLt's FP8 GEMMs instead (cuda.py: fp8_linear_cuda).
Paddle's weight layout is [in, out].
"""

from __future__ import annotations

import math
import warnings

import paddle
import paddle.nn.functional as F

from ..core.fp8.linear import Fp8LinearOp, FrozenFp8Weight
from ..core.fp8.weight_cache import weights_changed
from ..core.lora import Fp8Base, fused_applies, lora_linear
from ..ops._backend import BACKEND
from ..ops.lora_linear import lora_linear_fused
from ..ops._fallback import raise_if_strict
from ._autograd import pylayer
from .cuda import CUDA, GEMM_ALIGNMENT, backend_for, fp8_linear_cuda, prepare_cuda_linear
from .emulated import EMULATED
from .formats import quantize_dequantize
from .recipe import Fp8Recipe, LinearScalingStates
from .weight_cache import WeightCache

# cuBLASLt runs FP8 only with both operands K-major, 16-byte aligned rows: every GEMM dimension
# that is a K of the forward, dgrad or wgrad (in, out, tokens) must be a multiple of 16. The CUDA
# path pads the tokens of its transposed copies with zero columns (they change neither amax nor
# any GEMM result; cuda.py), which the emulation needs not; in and out are the weight's, so a
# misaligned weight keeps its layer in bf16.
FP8_ALIGNMENT = GEMM_ALIGNMENT
_warned: set[str] = set()


def _warn_once(key: str, message: str, category=UserWarning):
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, category, stacklevel=3)


def warn_emulated() -> None:
    """Once per process: the emulated FP8 path (fp8_linear, fp8_ffn) has FP8's numerics only."""
    _warn_once("emulated", "paddle_fastffn.fp8: FP8 GEMMs are emulated (fp32 GEMMs on FP8-rounded "
               "values): FP8 training numerics without its speed-up")


# The core's FP8 linear (core/fp8/linear.py) over the emulated backend.
_EmulatedFp8Linear = pylayer(Fp8LinearOp, EMULATED)


def fp8_linear(x: paddle.Tensor, weight: paddle.Tensor | None, bias: paddle.Tensor | None = None, *,
               states: LinearScalingStates, weight_cache: WeightCache | None = None,
               frozen_weight: FrozenFp8Weight | None = None) -> paddle.Tensor:
    """FP8 linear, emulated: x [..., in] (fp32/bf16/fp16) @ weight [in, out] (+ bias [out]).

    Quantisation: x and weight in states.input / states.weight's format and scale, the output
    gradient in states.grad_output's (see the module docstring); GEMMs in fp32; y and dx in
    x.dtype, dW in weight.dtype, db in bias.dtype. States are updated by every call (delayed
    scaling records amaxes). weight_cache: reuse the weight's FP8 copy until it changes (one
    quantisation per optimizer step); without one each GEMM's copy is quantised when it runs
    (core/fp8/linear.py weight_for_forward).
    frozen_weight: a FrozenFp8Weight in place of weight (None), for a frozen weight held only in FP8.
    Any shape works here; Fp8Linear decides which layers are worth and able to run in FP8."""
    warn_emulated()
    return _EmulatedFp8Linear.apply(x, weight, bias, states, weight_cache, frozen_weight)


def fp8_linear_ref(x, weight, bias=None, grad_output=None, *, input_scale, weight_scale,
                   grad_scale=None, forward_format: str = "e4m3", backward_format: str = "e5m2"):
    """Reference of fp8_linear with given scales, by the formulas of the module docstring, no
    autograd. Returns y, or (y, dx, dw, db) when grad_output is given (db None without bias)."""
    xq = quantize_dequantize(x.reshape([-1, x.shape[-1]]), input_scale, forward_format)
    wq = quantize_dequantize(weight, weight_scale, forward_format)
    y = xq @ wq + (0 if bias is None else bias.astype(paddle.float32))
    y = y.astype(x.dtype).reshape(x.shape[:-1] + [weight.shape[1]])
    if grad_output is None:
        return y
    dy2d = grad_output.reshape([-1, grad_output.shape[-1]])
    dyq = quantize_dequantize(dy2d, grad_scale, backward_format)
    dx = (dyq @ wq.t()).astype(x.dtype).reshape(x.shape)
    dw = (xq.t() @ dyq).astype(weight.dtype)
    db = None if bias is None else dy2d.astype(paddle.float32).sum(axis=0).astype(bias.dtype)
    return y, dx, dw, db


def _in_fp32_on_cpu(fn, *tensors):
    """fn(*tensors), upcast to fp32 where Paddle CPU lacks the 16-bit kernels (matmul, add,
    dropout) and cast back to the first tensor's dtype; fn as is elsewhere."""
    dtype = tensors[0].dtype
    if not (tensors[0].place.is_cpu_place() and dtype in (paddle.bfloat16, paddle.float16)):
        return fn(*tensors)
    up = [None if t is None else t.astype(paddle.float32) for t in tensors]
    return fn(*up).astype(dtype)


def _is_lora(layer) -> bool:
    # PaddleNLP's or PaddleFormers' LoRALinear (the same attributes), recognised by its attributes so
    # that neither library is imported here.
    return all(hasattr(layer, name) for name in ("lora_A", "lora_B", "scaling", "merged", "lora_dropout"))


def _move_storage(tensor: paddle.Tensor, place) -> None:
    """Give `tensor` (a parameter: its identity, name and optimizer slots stay) a copy of its data
    on `place`; its old buffer is freed when nothing else holds it."""
    tensor._copy_to(place, True)._share_buffer_to(tensor)


class Fp8Linear:
    """The FP8 path of one paddle.nn.Linear, or of PaddleNLP's or PaddleFormers' LoRALinear (base
    GEMM in FP8, adapters in the activation dtype: core/lora.py's LoraLinear op where its
    fused_applies, else lora_linear; LoRALinear.forward's math with the second adapter GEMM
    accumulating into the base output). Not a Layer: the wrapped layer
    keeps its parameters, names and checkpoints; this object holds the FP8 scaling states and
    the weight cache, and `fp8_state_dict` / `set_fp8_state_dict` save and restore the states.

    GEMMs stay in the activation dtype (bf16 in training) for a layer the recipe keeps out of FP8
    (first/last decoder layer), below recipe.min_gemm_size, and for weights whose in/out are not
    multiples of 16 (cuBLASLt's FP8 alignment; a warning, an error under PADDLE_FASTFFN_STRICT=1).

    backend: "auto" runs the CUDA FP8 GEMMs (cuda.py) for an input on a GPU where they can run
    (sm_90, a CUDA Paddle, the operators built) and the emulated fp8_linear everywhere else;
    "emulated" always emulates; "cuda" raises where the CUDA backend cannot run."""

    def __init__(self, linear: paddle.nn.Linear, recipe: Fp8Recipe, layer_index: int | None = None,
                 num_layers: int | None = None, backend: str = "auto"):
        if not isinstance(linear, paddle.nn.Linear):
            raise TypeError(f"Fp8Linear wraps paddle.nn.Linear (or a LoRALinear), got "
                            f"{type(linear).__name__}; tensor-parallel layers are not supported yet")
        if backend not in ("auto", "cuda", "emulated"):
            raise ValueError(f"Fp8Linear backend must be 'auto', 'cuda' or 'emulated', got {backend!r}")
        self.linear, self.recipe, self.backend = linear, recipe, backend
        self.states = recipe.linear_states()
        self.weight_cache = WeightCache()
        # A frozen LoRA base held only in FP8 (recipe.frozen_weights "fp8"): (its FrozenFp8Weight,
        # the weight's version when made), and the place its 16-bit copy left for host memory.
        self._frozen: tuple | None = None
        self._home = None
        self.frozen_quantizations = 0  # FrozenFp8Weights made (tests and logs read it)
        self._merged = getattr(linear, "merged", False)  # LoRA: whether the weight holds the adapters
        self.in_features, self.out_features = linear.weight.shape
        self.layer_in_fp8 = layer_index is None or recipe.layer_uses_fp8(layer_index, num_layers)
        self.aligned = self.in_features % FP8_ALIGNMENT == 0 and self.out_features % FP8_ALIGNMENT == 0
        if self.layer_in_fp8 and not self.aligned:
            message = (f"Fp8Linear: weight [{self.in_features}, {self.out_features}] is not a multiple "
                       f"of {FP8_ALIGNMENT} in both dimensions (cuBLASLt FP8 alignment); this layer "
                       f"stays in bf16")
            raise_if_strict(message)
            _warn_once(f"align{self.in_features}x{self.out_features}", message, RuntimeWarning)

    def uses_fp8(self, tokens: int) -> bool:
        """Whether a call on `tokens` tokens computes in FP8. Never for 0 tokens (a mixture-of-experts
        expert the router gave none): the amax of an empty tensor is 0, and recording it would mark
        the scaling states seeded (delayed scaling's warm start lost) and roll an empty step into
        their histories; the empty GEMM runs in the activation dtype, the states untouched."""
        return (tokens > 0 and self.layer_in_fp8 and self.aligned
                and self.recipe.gemm_uses_fp8(tokens, self.out_features, self.in_features))

    def __call__(self, x: paddle.Tensor) -> paddle.Tensor:
        layer = self.linear
        if not _is_lora(layer):
            return self._base(x)
        if getattr(layer, "pissa", False) and not layer.apply_pissa:  # as LoRALinear.forward: PiSSA init on first use
            layer.pissa_init(layer.r)  # rewrites the base weight (set_value)
            layer.apply_pissa = True
            weights_changed([layer.weight])
        if layer.merged != self._merged:  # eval()/train() merged or unmerged the adapters (set_value)
            weights_changed([layer.weight])
            self._merged = layer.merged
        # merged: the adapters are inside the weight (PaddleNLP's eval with merge_weights, PaddleFormers'
        # merge()); disable_lora: PaddleFormers' switch that runs the base alone.
        if layer.merged or getattr(layer, "disable_lora", False):
            return self._base(x)
        if BACKEND.gemm_dtype(x) == x.dtype:  # not 16-bit on the CPU, where dropout runs upcast below
            dropped = layer.lora_dropout(x)
            if fused_applies(BACKEND, x, dropped, layer.weight, layer.bias, layer.lora_A, layer.lora_B):
                fused = self._fused_lora(x)
                if fused is not None:
                    return fused
            return lora_linear(BACKEND, dropped, self._base(x), layer.lora_A, layer.lora_B, layer.scaling)
        base = self._base(x)

        def add_adapters(x, base, lora_a, lora_b):
            return lora_linear(BACKEND, layer.lora_dropout(x), base, lora_a, lora_b, layer.scaling)

        return _in_fp32_on_cpu(add_adapters, x, base, layer.lora_A, layer.lora_B)

    def holds_frozen_weight(self) -> bool:
        """Whether this layer's base weight is held only in FP8: LoRA's frozen base under
        recipe.frozen_weights "fp8" or "fp8_both", in a layer that computes in FP8."""
        return (self.recipe.frozen_weights != "resident" and _is_lora(self.linear) and self.linear.weight.stop_gradient
                and self.layer_in_fp8 and self.aligned)

    def _base(self, x):
        tokens = math.prod(x.shape[:-1])
        if self.uses_fp8(tokens):
            cuda, weight, cache, frozen = self._fp8_operands(x)
            linear = fp8_linear_cuda if cuda else fp8_linear
            return linear(x, weight, self.linear.bias, states=self.states, weight_cache=cache, frozen_weight=frozen)
        if tokens == 0 and self._home is not None:  # a base held only in FP8 stays so: no token to multiply
            return paddle.zeros(list(x.shape[:-1]) + [self.out_features], x.dtype)
        self.restore_weight()  # a GEMM below recipe.min_gemm_size reads the 16-bit weight
        weight, bias = self.linear.weight, self.linear.bias
        return _in_fp32_on_cpu(F.linear, x, weight.astype(x.dtype),
                               None if bias is None else bias.astype(x.dtype))

    def _fused_lora(self, x):
        """The LoRA projection as core/lora.py's LoraLinear (its caller checked fused_applies), with
        the base _base would compute: in FP8 or 16-bit; None where _base's base is neither (no token,
        with the base held only in FP8)."""
        layer = self.linear
        tokens = math.prod(x.shape[:-1])
        if self.uses_fp8(tokens):
            cuda, weight, cache, frozen = self._fp8_operands(x)
            if cuda:  # what fp8_linear_cuda and fp8_linear do before their op
                prepare_cuda_linear(x, weight, frozen, self.states)
            else:
                warn_emulated()
            fp8_base = Fp8Base(CUDA if cuda else EMULATED, self.states, cache, frozen)
            return lora_linear_fused(x, weight, layer.lora_A, layer.lora_B, layer.scaling, fp8_base)
        if tokens == 0 and self._home is not None:
            return None
        self.restore_weight()
        return lora_linear_fused(x, layer.weight, layer.lora_A, layer.lora_B, layer.scaling)

    def _fp8_operands(self, x):
        """What an FP8 base GEMM on x takes: (whether it runs on CUDA, the weight or None where a
        FrozenFp8Weight holds it, the weight cache or None, that FrozenFp8Weight or None)."""
        weight = self.linear.weight
        cuda = backend_for(self.backend, x) == "cuda"
        frozen = self.frozen_weight(x.place, cuda) if self.holds_frozen_weight() else None
        cache = self.weight_cache if self.recipe.caches_weight(not weight.stop_gradient) else None
        return cuda, None if frozen is not None else weight, cache, frozen

    def frozen_weight(self, place, cuda: bool) -> FrozenFp8Weight:
        """The base weight's FrozenFp8Weight, made on `place` from the 16-bit weight the first time
        and again whenever the weight changed (a load, LoRA's merge, PiSSA: its version moved); the
        16-bit weight then leaves the device for host memory (_move_storage)."""
        weight = self.linear.weight
        version = self.weight_cache.version(weight)
        if self._frozen is not None and self._frozen[1] == version:
            return self._frozen[0]
        self.restore_weight()
        backend = CUDA if cuda else EMULATED
        if cuda:
            states_on(self.states, place)
        frozen = FrozenFp8Weight.freeze(backend, weight, self.states.weight,
                                        both_copies=self.recipe.frozen_weights == "fp8_both")
        self.frozen_quantizations += 1
        self._home = weight.place
        _move_storage(weight, paddle.CUDAPinnedPlace() if weight.place.is_gpu_place() else paddle.CPUPlace())
        self._frozen = (frozen, self.weight_cache.version(weight))
        return frozen

    def restore_weight(self) -> None:
        """Put the 16-bit base weight back where it was (the device) and drop its FP8-only copy:
        before stock code reads or rewrites it there (LoRA's merge on train()/eval()), and when the
        FP8 path is detached."""
        if self._home is not None:
            _move_storage(self.linear.weight, self._home)
            self._home, self._frozen = None, None

    def fp8_state_dict(self) -> dict:
        return self.states.state_dict()

    def set_fp8_state_dict(self, state: dict):
        self.states.set_state_dict(state)
