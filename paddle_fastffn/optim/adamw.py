"""AdamW with Paddle's semantics, one pass over memory per parameter.

Stack, in the project's op order: the compiled op call (``_adamw_op``: csrc/paddle/adamw_op.cc over
fastffn/optimizer.h) -> the public in-place update of one tensor (``adamw_update_``) -> the
optimizer (``FastAdamW``, a drop-in ``paddle.optimizer.AdamW``) -> the pure-Paddle reference
(``adamw_ref``).

The update is the one of Paddle's CUDA adamw kernel, in fp32, on the CPU and CUDA alike: decoupled
decay of the (master) weight, fp32 moments, bias corrections from the beta powers. For bf16
parameters with fp32 masters it reads the bf16 gradient, the master and both moments and writes
master, moments and the bf16 parameter: 28 bytes per parameter, no fp32 copy of the gradient.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import paddle
from paddle import _C_ops
from paddle.base import framework, unique_name
from paddle.optimizer.lr import LRScheduler

from ..core import optimizer as core_optimizer

from ..ops import _checks
from ..ops._loader import run_op
from ..core.fp8.weight_cache import updated_parameters, weights_changed

OP = "paddle_fastffn.optim.adamw"
_KERNEL_DTYPES = (paddle.float32, paddle.float16, paddle.bfloat16)
_INFORMED: set[str] = set()


def _adamw_op(param, grad, learning_rate, moment1, moment2, beta1_pow, beta2_pow, master_param,
              grad_scale, beta1, beta2, epsilon, lr_ratio, coeff, with_decay, compensation=None,
              moment1_absmax=None, moment2_absmax=None, param_amax=None) -> None:
    # detach: the same memory, without autograd's refusal to update a trainable leaf in place
    # (Paddle's own optimizer ops write parameters the same way, outside autograd).
    run_op("fastffn_adamw_", param.detach(), grad, learning_rate, moment1, moment2, beta1_pow, beta2_pow,
           master_param, grad_scale, compensation, moment1_absmax, moment2_absmax, param_amax, float(beta1),
           float(beta2), float(epsilon), float(lr_ratio), float(coeff), bool(with_decay))


def _check_scalar(value, name: str) -> None:
    _checks.check_tensor(value, OP, name)
    if value.dtype != paddle.float32 or value.size != 1:
        raise TypeError(f"{OP}: argument `{name}` must be a one-element float32 tensor, got "
                        f"{value.dtype} with shape {list(value.shape)}")


def _check_like_param(param, value, name: str, dtypes) -> None:
    _checks.check_tensor(value, OP, name)
    if value.dtype not in dtypes:
        raise TypeError(f"{OP}: argument `{name}` must be {' or '.join(map(str, dtypes))}, got "
                        f"{value.dtype}")
    if value.size != param.size:
        raise ValueError(f"{OP}: argument `{name}` must have the {param.size} elements of `param` "
                         f"{list(param.shape)}, got shape {list(value.shape)}")
    _checks.check_same_device(param, "param", value, OP, name)
    if not value.is_contiguous():
        raise ValueError(f"{OP}: argument `{name}` must be contiguous (it is updated in place)")


def _check_absmax(param, absmax, name: str) -> None:
    _checks.check_tensor(absmax, OP, name)
    blocks = core_optimizer.absmax_blocks(param.size)
    if absmax.dtype != paddle.float32 or absmax.size != blocks:
        raise ValueError(f"{OP}: argument `{name}` must be float32 with {blocks} elements (one per "
                         f"{core_optimizer.QUANT_BLOCK} of `param`), got {absmax.dtype} with shape "
                         f"{list(absmax.shape)}")
    _checks.check_same_device(param, "param", absmax, OP, name)


def _check_moments(param, moment1, moment2, moment1_absmax, moment2_absmax) -> None:
    """fp32 moments, or uint8 codes with their absmax (8-bit moments)."""
    _checks.check_tensor(moment1, OP, "moment1")
    dtype = paddle.uint8 if moment1.dtype == paddle.uint8 else paddle.float32
    _check_like_param(param, moment1, "moment1", (dtype,))
    _check_like_param(param, moment2, "moment2", (dtype,))
    for absmax, name in ((moment1_absmax, "moment1_absmax"), (moment2_absmax, "moment2_absmax")):
        if dtype == paddle.float32 and absmax is not None:
            raise ValueError(f"{OP}: argument `{name}` goes with uint8 (8-bit) moments only")
        if dtype == paddle.uint8:
            if absmax is None:
                raise ValueError(f"{OP}: argument `{name}` is needed with uint8 (8-bit) moments")
            _check_absmax(param, absmax, name)


def _check_update_args(param, grad, learning_rate, moment1, moment2, beta1_pow, beta2_pow,
                       master_param, grad_scale, compensation=None, moment1_absmax=None,
                       moment2_absmax=None, param_amax=None) -> None:
    _checks.check_tensor(param, OP, "param")
    if param.dtype not in _KERNEL_DTYPES:
        raise TypeError(f"{OP}: argument `param` must be float32, float16 or bfloat16, got "
                        f"{param.dtype}")
    if not param.is_contiguous():
        raise ValueError(f"{OP}: argument `param` must be contiguous (it is updated in place)")
    _check_like_param(param, grad, "grad", (param.dtype, paddle.float32))
    _check_moments(param, moment1, moment2, moment1_absmax, moment2_absmax)
    if master_param is not None:
        _check_like_param(param, master_param, "master_param", (paddle.float32,))
    if compensation is not None:
        if master_param is not None:
            raise ValueError(f"{OP}: arguments `master_param` and `compensation` exclude each other")
        if param.dtype == paddle.float32:
            raise TypeError(f"{OP}: argument `compensation` needs a float16 or bfloat16 `param`, got float32")
        _check_like_param(param, compensation, "compensation", (param.dtype,))
    _check_scalar(learning_rate, "learning_rate")
    _check_scalar(beta1_pow, "beta1_pow")
    _check_scalar(beta2_pow, "beta2_pow")
    if grad_scale is not None:
        _check_scalar(grad_scale, "grad_scale")
    if param_amax is not None:
        _check_scalar(param_amax, "param_amax")
        _checks.check_same_device(param, "param", param_amax, OP, "param_amax")
    if not _checks.kernel_supports_place(param):
        raise ValueError(f"{OP}: no compiled kernel for parameters on {param.place}")


def adamw_update_(param, grad, learning_rate, moment1, moment2, beta1_pow, beta2_pow,
                  master_param=None, *, beta1: float = 0.9, beta2: float = 0.999,
                  epsilon: float = 1e-8, weight_decay: float = 0.01, lr_ratio: float = 1.0,
                  with_decay: bool = True, grad_scale=None, compensation=None,
                  moment1_absmax=None, moment2_absmax=None, param_amax=None) -> None:
    """One AdamW step of one tensor, in place (Paddle's ``_C_ops.adamw_`` for a dense gradient).

    param [any shape] float32/float16/bfloat16; grad: param's dtype or float32, same size;
    master_param (fp32, or None: the update is computed from param), moment1, moment2: float32,
    same size. learning_rate, beta1_pow (beta1^t at step t), beta2_pow, grad_scale (a gradient
    multiplier, e.g. the global-norm clip coefficient; None = 1): one-element float32 tensors on
    the CPU or on param's device. fp32 math -> param in its dtype. Afterwards beta1_pow and
    beta2_pow are multiplied by beta1 and beta2, as Paddle's kernel does.

    Low-memory state (fastffn/optimizer.h): moment1/moment2 uint8 codes with moment1_absmax /
    moment2_absmax float32 [ceil(size / 256)] (8-bit moments: dequantised, updated in fp32 and
    requantised in the same pass); compensation (param's dtype, 16-bit params, no master_param):
    the update runs on float(param) + float(compensation), both rewritten (Kahan summation).

    param_amax (a one-element float32 tensor where param lives, or None): set to max |param| of
    the updated parameter as stored, what an FP8 quantisation's amax pass over it would give
    (fastffn/optimizer.h; the FP8 weight cache reads it, core/fp8/weight_cache.py AmaxSlot).
    """
    _check_update_args(param, grad, learning_rate, moment1, moment2, beta1_pow, beta2_pow,
                       master_param, grad_scale, compensation, moment1_absmax, moment2_absmax, param_amax)
    _adamw_op(param, grad, learning_rate, moment1, moment2, beta1_pow, beta2_pow, master_param,
              grad_scale, beta1, beta2, epsilon, lr_ratio, weight_decay, with_decay, compensation,
              moment1_absmax, moment2_absmax, param_amax)


def _inform(reason: str) -> None:
    """Paddle's own update runs where the kernel does not apply: one info line per reason."""
    if reason not in _INFORMED:
        _INFORMED.add(reason)
        from ..integration.library import logger

        logger().info(f"paddle_fastffn: FastAdamW: {reason}: those parameters take Paddle's own "
                      f"AdamW update")


def _as_float(value) -> float:
    """A hyper-parameter given as a float or a Tensor (read once per step, as Paddle does)."""
    return float(value.item(0)) if isinstance(value, (framework.Variable, paddle.Tensor)) else float(value)


def _selected_rows(grad) -> bool:
    return hasattr(grad, "is_selected_rows") and grad.is_selected_rows()


def _need_clip(param) -> bool:
    return getattr(param, "need_clip", True) is not False


class PaddleOptimizerBackend:
    """The optimizer step's backend (paddle_fastffn/core/optimizer.py) in Paddle dygraph: Paddle's
    own ops for the clip, our compiled adamw op for the update."""

    _PRECISION = {paddle.float16: core_optimizer.HALF, paddle.bfloat16: core_optimizer.HALF,
                  paddle.float32: core_optimizer.SINGLE}

    def precision(self, t):
        return self._PRECISION.get(t.dtype, core_optimizer.DOUBLE)

    def squared_norm(self, grad):
        if grad.dtype in (paddle.float16, paddle.bfloat16) and grad.place.is_cpu_place():
            # Paddle's CPU build has no 16-bit squared_l2_norm (its own clip fails there): fp32,
            # as Paddle computes it with paddle.nn.clip._clip_by_global_norm_using_mp_type(True).
            grad = grad.astype(paddle.float32)
        return paddle.nn.clip._squared_l2_norm(grad)

    def stack(self, scalars):
        return paddle.stack(scalars)

    def sum(self, t, dtype):
        return paddle.sum(t, dtype=dtype)

    def sqrt(self, t):
        return paddle.sqrt(t)

    def maximum(self, a, b):
        return paddle.maximum(a, b)

    def divide(self, a, b):
        return paddle.divide(a, b)

    def greater(self, a, b):
        return paddle.greater_than(a, b)

    def where(self, condition, a, b):
        return paddle.where(condition, a, b)

    def full(self, value, dtype, like):
        return paddle.full(shape=[1], dtype=dtype, fill_value=value)

    def to_float32(self, t):
        return t.astype(paddle.float32)

    def dtype_name(self, t):
        return str(t.dtype).replace("paddle.", "")

    def same_device(self, a, b):
        return a.place == b.place

    def fill_(self, t, value):
        _C_ops.full_(t, list(t.shape), float(value), t.dtype, t.place)

    def adamw(self, update, learning_rate, grad_scale, hyper):
        _adamw_op(update.param, update.grad, learning_rate, update.moment1, update.moment2, update.beta1_pow,
                  update.beta2_pow, update.master, grad_scale, hyper.beta1, hyper.beta2, hyper.epsilon,
                  update.lr_ratio, hyper.weight_decay, update.with_decay, update.compensation,
                  update.moment1_absmax, update.moment2_absmax, update.param_amax)


_BACKEND = PaddleOptimizerBackend()


def global_norm_clip_coefficient(clip: paddle.nn.ClipGradByGlobalNorm, params_grads):
    """clip_norm / max(global_norm, clip_norm) of the gradients paddle.nn.ClipGradByGlobalNorm would
    clip (need_clip), without scaling any gradient (core/optimizer.py's clip_coefficient: Paddle's
    squared norm per gradient, its dtype groups, summed into float64 when any gradient is float64,
    else float32): a [1] tensor in that sum dtype on the gradients' device, or None when no
    gradient is clipped. auto_skip_clip: 1 where Paddle skips the clip (global_norm <= clip_norm),
    decided on the device instead of by a host read."""
    grads = [grad for param, grad in params_grads if grad is not None and _need_clip(param)]
    return core_optimizer.clip_coefficient(_BACKEND, grads, core_optimizer.GlobalNormClip(
        float(clip.clip_norm), bool(clip.auto_skip_clip)))


def _distributed() -> bool:
    return paddle.distributed.get_world_size() > 1


# --- 8-bit moments in Paddle ops: what the kernel stores, for checkpoints in the stock layout -----
# Extra state_dict keys beside each quantised moment's fp32 entry (stock AdamW ignores them): the
# codes and absmax themselves, because dequantising and quantising again is not always exact. A
# block whose largest |m1| is negative dequantises to a largest |value| of 0.99297 absmax (the signed
# map has no -1.0), so quantising again gives it that smaller absmax (the codes stay), and the
# resumed moments differ from the saved ones by 0.7% in such blocks; m2 (unsigned, its largest
# element is code 1.0) comes back exactly. tests/optim/test_adamw_low_memory.py shows both.
QUANT_CODES_KEY, QUANT_ABSMAX_KEY = ".quant_codes", ".quant_absmax"
_MAPS: dict = {}


def _dynamic_map(signed: bool, place):
    key = (signed, str(place))
    if key not in _MAPS:
        _MAPS[key] = paddle.to_tensor(np.asarray(core_optimizer.dynamic_map(signed), dtype=np.float32), place=place)
    return _MAPS[key]


def dequantize_blockwise(codes, absmax, signed: bool):
    """float32 [codes.size]: map[code] * its block's absmax (signed: moment1's map, else moment2's)."""
    values = paddle.gather(_dynamic_map(signed, codes.place), codes.flatten().astype(paddle.int64))
    return values * paddle.repeat_interleave(absmax.flatten(), core_optimizer.QUANT_BLOCK)[:codes.size]


def quantize_blockwise(values, signed: bool):
    """(uint8 codes [size], float32 absmax [blocks]) of values, by the kernel's rule (fastffn/optimizer.h):
    absmax = max |x| per block of QUANT_BLOCK, code = the nearest map entry to x / absmax (ties:
    the lower code; an all-zero block: absmax 0 and the code of 0.0)."""
    flat = values.flatten().astype(paddle.float32)
    size, block = flat.size, core_optimizer.QUANT_BLOCK
    blocks = core_optimizer.absmax_blocks(size)
    padded = paddle.concat([flat, paddle.zeros([blocks * block - size], paddle.float32)]).reshape([blocks, block])
    absmax = paddle.max(paddle.abs(padded), axis=1)
    nonzero = (absmax > 0).unsqueeze(1)
    scaled = paddle.where(nonzero, padded / paddle.where(nonzero, absmax.unsqueeze(1), paddle.ones_like(padded)),
                          paddle.zeros_like(padded)).flatten()[:size]
    table = _dynamic_map(signed, flat.place)
    lower = paddle.clip(paddle.searchsorted(table, scaled, right=True) - 1, 0, table.size - 2)
    upper = lower + 1
    nearer_lower = scaled - paddle.gather(table, lower) <= paddle.gather(table, upper) - scaled
    return paddle.where(nearer_lower, lower, upper).astype(paddle.uint8), absmax


class _QuantizedMoment:
    """One parameter's 8-bit moment (uint8 codes, fp32 absmax per block) and the name stock AdamW
    gives that moment's fp32 accumulator (its state_dict key)."""

    def __init__(self, name: str, like, signed: bool):
        self.name, self.signed, self.shape = name, signed, list(like.shape)
        zero_code = core_optimizer.dynamic_map(signed).index(0.0)
        self.codes = paddle.full([like.size], zero_code, paddle.uint8)
        self.absmax = paddle.zeros([core_optimizer.absmax_blocks(like.size)], paddle.float32)

    def dequantized(self):
        values = dequantize_blockwise(self.codes, self.absmax, self.signed).reshape(self.shape)
        values.name = self.name
        return values

    def save(self, state: dict) -> None:
        state[self.name] = self.dequantized()
        state[self.name + QUANT_CODES_KEY] = self.codes
        state[self.name + QUANT_ABSMAX_KEY] = self.absmax

    def load(self, state: dict) -> None:
        """From a state dict (popping this moment's keys): the saved codes where they dequantise to
        the fp32 entry bit for bit (our own checkpoint), else the fp32 entry quantised."""
        values = state.pop(self.name).flatten().astype(paddle.float32)
        codes, absmax = state.pop(self.name + QUANT_CODES_KEY, None), state.pop(self.name + QUANT_ABSMAX_KEY, None)
        saved_codes_match = (codes is not None and absmax is not None and codes.size == self.codes.size
                             and absmax.size == self.absmax.size
                             and bool(paddle.equal_all(dequantize_blockwise(codes, absmax, self.signed), values)))
        if not saved_codes_match:
            codes, absmax = quantize_blockwise(values, self.signed)
        self.codes.set_value(codes.flatten().astype(paddle.uint8))
        self.absmax.set_value(absmax.flatten().astype(paddle.float32))


def compensation_from_master(master, param):
    """The Kahan compensation that makes float(param) + float(compensation) the fp32 master (to the
    compensation's 16 bits): round(master - float(param)) in param's dtype."""
    return (master.astype(paddle.float32) - param.astype(paddle.float32)).astype(param.dtype)


def master_from_compensation(compensation, param):
    """float32(param) + float32(compensation): the fp32 master the pair stands for (exact in fp32)."""
    return param.astype(paddle.float32) + compensation.astype(paddle.float32)


class FastAdamW(paddle.optimizer.AdamW):
    """``paddle.optimizer.AdamW`` whose update of each dense parameter is one compiled pass.

    Same constructor and the same state: accumulators, master weights, learning-rate schedulers,
    apply_decay_param_fun, lr_ratio, parameter groups and state_dict/set_state_dict are Paddle's
    own, so optimizer checkpoints move between FastAdamW and paddle.optimizer.AdamW both ways. In
    dygraph, parameters of float32/float16/bfloat16 with dense gradients on the CPU or a CUDA GPU
    go through the kernel (bf16/fp16 ones with multi_precision: from their fp32 master weights;
    also on the CPU, where Paddle has no 16-bit AdamW kernel). Paddle's own update runs, with one
    info line per reason, for amsgrad, lazy_mode, low-precision moments, sparse gradients, float64
    or distributed parameters, other devices and static graphs; ``deferred`` counts those reasons.

    grad_clip=paddle.nn.ClipGradByGlobalNorm (that exact class) is fused: the coefficient is
    computed as Paddle computes it and the kernel multiplies each clipped gradient by it as it
    reads it, instead of Paddle writing a scaled copy of every gradient first. Unlike Paddle, the
    parameters' ``.grad`` keep their unclipped values after step(). With bf16 (or fp16) gradients
    the kernel multiplies the upcast gradient by the fp32 coefficient in fp32, where Paddle rounds
    the coefficient and the scaled gradient to the gradient's dtype: results are at least as
    accurate as Paddle's, but not bit-identical to Paddle GPU's AdamW. Other clip classes run as
    in Paddle.

    The step is core/optimizer.py's composition, which the GPU harness's FusedMasterAdamW runs too:
    with a learning-rate scheduler the learning-rate tensor is written only when the value changed
    (Paddle fills it before every step), and clear_grad() releases the gradients instead of
    zero-filling them in a single-process run (see clear_grad).

    lr_ratio works on the CPU too (Paddle's constructor refuses it there because its CPU kernel
    would apply the ratio to the decay only); a parameter that would take Paddle's own CPU update
    with an lr_ratio raises NotImplementedError.

    Low-memory state (fastffn/optimizer.h says how and why), the defaults being Paddle's layout:
    moments="int8" keeps both moments of every tensor of at least min_8bit_size (4096) elements as
    8-bit blockwise-quantised codes (1 byte each plus one fp32 absmax per 256 elements; smaller
    tensors keep fp32 moments); master_weights="compensated" replaces multi_precision's fp32 master
    of each 16-bit parameter by a 16-bit Kahan compensation (2 bytes instead of 4). Checkpoints keep
    Paddle's layout: state_dict() holds the moments dequantised to fp32 under Paddle's names (plus
    the codes and absmax under extra keys, see QUANT_CODES_KEY) and, for compensated parameters,
    master_weights = float32(param) + float32(compensation); set_state_dict() takes Paddle's layout
    (moments quantised, compensation = master - param rounded; load the model weights first). Both
    need the kernel for every such parameter: they refuse amsgrad, lazy_mode and
    use_lowprecision_moment, and a parameter that would need Paddle's own update raises.
    """

    def __init__(self, learning_rate=0.001, beta1=0.9, beta2=0.999, epsilon=1e-8, parameters=None,
                 weight_decay=0.01, use_lowprecision_moment=False, lr_ratio=None,
                 apply_decay_param_fun=None, grad_clip=None, lazy_mode=False,
                 multi_precision=False, amsgrad=False, name=None, moments="fp32",
                 master_weights="fp32", min_8bit_size=core_optimizer.MIN_8BIT_SIZE):
        self._state_format = core_optimizer.StateFormat(moments, master_weights, min_8bit_size)
        if self._state_format.compact:
            for flag, value in (("amsgrad", amsgrad), ("lazy_mode", lazy_mode),
                                ("use_lowprecision_moment", use_lowprecision_moment)):
                if value:
                    raise ValueError(f"{OP}: argument `{flag}` cannot go with moments={moments!r}, "
                                     f"master_weights={master_weights!r} (the kernel has no such update)")
        # {accumulator name: {owner name: _QuantizedMoment}} beside Paddle's _accumulators, and
        # {param name: compensation} (also in _master_weights, standing in for the master).
        self._quantized_moments: dict = {}
        self._compensations: dict = {}
        super().__init__(learning_rate=learning_rate, beta1=beta1, beta2=beta2, epsilon=epsilon,
                         parameters=parameters, weight_decay=weight_decay,
                         use_lowprecision_moment=use_lowprecision_moment, lr_ratio=None,
                         apply_decay_param_fun=apply_decay_param_fun, grad_clip=grad_clip,
                         lazy_mode=lazy_mode, multi_precision=multi_precision, amsgrad=amsgrad,
                         name=name)
        if lr_ratio is not None and not callable(lr_ratio):
            raise TypeError(f"{OP}: argument `lr_ratio` must be callable (param -> float), got "
                            f"{type(lr_ratio).__name__}")
        self._lr_ratio = lr_ratio
        self.deferred: Counter = Counter()
        # While a step runs with the global-norm clip fused: Paddle's coefficient (in its sum
        # dtype, for gradients that take Paddle's update) and its fp32 value (for the kernel).
        self._clip_coefficient = self._clip_coefficient_fp32 = None
        self._learning_rate_slot = core_optimizer.LearningRateSlot()

    # --- the learning rate and the gradients: no device work that changes nothing ------------
    def _create_global_learning_rate(self):
        """Paddle's, except that in dygraph a scheduler's value is written into the learning-rate
        tensor only when it changed (Paddle fills it before every step)."""
        current = self._global_learning_rate()
        if current is None or not framework.in_dygraph_mode() or not isinstance(self._learning_rate, LRScheduler):
            super()._create_global_learning_rate()
            scheduled = isinstance(self._learning_rate, LRScheduler)
            self._learning_rate_slot.written_elsewhere(float(self._learning_rate()) if scheduled else None)
            return
        self._learning_rate_slot.set(_BACKEND, current, float(self._learning_rate()))

    def clear_grad(self, set_to_zero: bool | None = None) -> None:
        """Paddle's clear_grad; by default (None) the gradients are released instead of zero-filled
        in a single-process run: the next backward writes each gradient afresh (a released .grad
        takes the first micro-batch's gradient as it is, later micro-batches add to it, exactly as
        into zeros), so the fill of every gradient after each step is memory traffic for nothing.
        Where several processes train (data parallel, sharding, pipeline), communication buffers
        may hold the gradients: zero-filled there, as Paddle does. True / False: Paddle's meaning."""
        if set_to_zero is None:
            set_to_zero = _distributed()
        super().clear_grad(set_to_zero)

    # --- which parameters the kernel takes --------------------------------------------------
    def _optimizer_reason(self) -> str | None:
        if not framework.in_dygraph_mode():
            return "static graphs and to_static programs"
        if self._amsgrad:
            return "amsgrad"
        if self._lazy_mode:
            return "lazy_mode"
        return None

    def _parameter_reason(self, param, grad, moment1, learning_rate) -> str | None:
        if _selected_rows(grad):
            return "sparse (SelectedRows) gradients"
        if param.dtype not in _KERNEL_DTYPES:
            return f"{param.dtype} parameters"
        if grad.dtype not in (param.dtype, paddle.float32):
            return f"{grad.dtype} gradients of {param.dtype} parameters"
        if moment1.dtype not in (paddle.float32, paddle.uint8):
            return "low-precision moments (use_lowprecision_moment)"
        if learning_rate.dtype != paddle.float32:
            return f"a {learning_rate.dtype} learning rate"
        if param.is_dist():
            return "distributed (DistTensor) parameters"
        if not _checks.kernel_supports_place(param):
            return f"parameters on {param.place}"
        return None

    # --- low-memory state: where it replaces Paddle's accumulators and masters ----------------
    def _kernel_keeps(self, param) -> bool:
        """Whether param's state may take a layout only the kernel updates."""
        return (param.dtype in _KERNEL_DTYPES and not param.is_dist() and framework.in_dygraph_mode()
                and _checks.kernel_supports_place(param))

    def _create_master_weight(self, param):
        """multi_precision's fp32 master, or under master_weights="compensated" the 16-bit
        compensation standing in for it (under the name Paddle gives the master, so that the
        moments keyed by it keep Paddle's names); a master that set_state_dict loaded becomes the
        compensation against the current weight."""
        if self._state_format.master_weights != "compensated" or not self._kernel_keeps(param):
            return super()._create_master_weight(param)
        if param.name in self._compensations:
            return self._compensations[param.name]
        loaded = self._master_weights.get(param.name)
        if loaded is None:
            name = self._gen_master_weight_var_name(param)
            compensation = paddle.zeros(param.shape, param.dtype)
        else:
            name = loaded.name
            compensation = compensation_from_master(loaded.reshape(param.shape), param)
        compensation.name = name
        self._master_weights[param.name] = self._compensations[param.name] = compensation
        return compensation

    def _add_accumulator(self, name, param, dtype=None, fill_value=0.0, shape=None, type=None, device=None):
        """Paddle's, except that a moment of a tensor of at least min_8bit_size elements under
        moments="int8" is a _QuantizedMoment, named as Paddle names the fp32 moment (its
        unique name is drawn as Paddle draws it, so the other accumulators keep theirs)."""
        if (name not in (self._moment1_acc_str, self._moment2_acc_str)
                or not self._state_format.quantizes(param.size) or not self._kernel_keeps(param)):
            return super()._add_accumulator(name, param, dtype, fill_value, shape, type, device)
        key = name if self._name is None else f"{self._name}_{name}"
        moments = self._quantized_moments.setdefault(key, {})
        if param.name not in moments:
            moment = _QuantizedMoment(unique_name.generate(f"{param.name}_{key}"), param,
                                      signed=name == self._moment1_acc_str)
            if self._accumulators_holder:  # set_state_dict ran before the first step (Paddle's check)
                if moment.name not in self._accumulators_holder:
                    raise KeyError(f"{OP}: the loaded optimizer state has no {moment.name}")
                moment.load(self._accumulators_holder)
            moments[param.name] = moment
        return moments[param.name]

    def _moment(self, name: str, param):
        """param's moment `name`: (values, absmax): fp32 and None, or uint8 codes and their absmax."""
        owner = self._master_weights[param.name] \
            if self._multi_precision and self._is_dtype_fp16_or_bf16(param.dtype) else param
        key = name if self._name is None else f"{self._name}_{name}"
        quantized = self._quantized_moments.get(key, {}).get(owner.name)
        if quantized is not None:
            return quantized.codes, quantized.absmax
        return self._get_accumulator_master(name, param), None

    def _keeps_low_memory_state(self, param) -> bool:
        return param.name in self._compensations or any(
            param.name in moments or self._master_weights.get(param.name, param).name in moments
            for moments in self._quantized_moments.values())

    def state_dict(self):
        """Paddle's layout (see the class): quantised moments as fp32 under Paddle's names (their
        codes and absmax beside them), compensated parameters' masters reconstructed."""
        state = super().state_dict()
        for moments in self._quantized_moments.values():
            for moment in moments.values():
                moment.save(state)
        if self._compensations:
            masters = dict(state.get("master_weights", {}))
            for param in self._parameter_list_flat():
                compensation = self._compensations.get(param.name)
                if compensation is not None:
                    masters[param.name] = master_from_compensation(compensation, param)
                    masters[param.name].name = compensation.name
            state["master_weights"] = masters
        return state

    def set_state_dict(self, state_dict):
        """Paddle's set_state_dict, with quantised moments and compensations taken from Paddle's
        layout (or our own extra keys, see _QuantizedMoment.load); where the state does not exist
        yet, it is made from the loaded values at the first step, as Paddle does."""
        state = dict(state_dict)
        for moments in self._quantized_moments.values():
            for moment in moments.values():
                moment.load(state)
        masters = dict(state.get("master_weights", {}))
        for param in self._parameter_list_flat():
            compensation = self._compensations.get(param.name)
            if compensation is not None and param.name in masters:
                compensation.set_value(compensation_from_master(masters.pop(param.name).reshape(param.shape), param))
        if "master_weights" in state:
            state["master_weights"] = {**self._master_weights, **masters} if self._compensations else masters
        super().set_state_dict(state)

    def _parameter_list_flat(self):
        params = self._parameter_list or []
        if params and isinstance(params[0], dict):
            return [p for group in params for p in group["params"]]
        return list(params)

    # --- one parameter's update -------------------------------------------------------------
    def _append_optimize_op(self, block, param_and_grad):
        if isinstance(param_and_grad, dict):
            param_and_grad = self._update_param_group(param_and_grad)
        param, grad = param_and_grad
        reason = self._optimizer_reason()
        if reason is not None:
            return self._paddle_update(block, param, grad, reason)
        moment1, moment1_absmax = self._moment(self._moment1_acc_str, param)
        learning_rate = self._create_param_lr((param, grad))
        reason = self._parameter_reason(param, grad, moment1, learning_rate)
        if reason is not None:
            return self._paddle_update(block, param, grad, reason)
        moment2, moment2_absmax = self._moment(self._moment2_acc_str, param)
        compensation = self._compensations.get(param.name)
        find_master = self._multi_precision and self._is_dtype_fp16_or_bf16(param.dtype) and compensation is None
        clipped = self._clip_coefficient_fp32 is not None and _need_clip(param)
        update = core_optimizer.ParameterUpdate(
            param, grad, moment1, moment2,
            self._master_weights[param.name] if find_master else None,
            self._get_accumulator_master(self._beta1_pow_acc_str, param),
            self._get_accumulator_master(self._beta2_pow_acc_str, param),
            lr_ratio=1.0 if self._lr_ratio is None else self._lr_ratio(param),
            with_decay=self._apply_decay_param_fun is None or self._apply_decay_param_fun(param.name),
            clipped=clipped, compensation=compensation, moment1_absmax=moment1_absmax,
            moment2_absmax=moment2_absmax)
        hyper = core_optimizer.AdamWHyper(_as_float(self._beta1), _as_float(self._beta2), _as_float(self._epsilon),
                                          float(self._weight_decay))
        core_optimizer.update_parameters(_BACKEND, [update], learning_rate, self._clip_coefficient_fp32, hyper)
        return None

    def _paddle_update(self, block, param, grad, reason):
        if self._keeps_low_memory_state(param):
            raise NotImplementedError(
                f"{OP}: {param.name} keeps low-memory optimizer state (moments="
                f"{self._state_format.moments!r}, master_weights={self._state_format.master_weights!r}), "
                f"which only the kernel updates, but takes Paddle's own update here: {reason}")
        self.deferred[reason] += 1
        _inform(reason)
        if self._lr_ratio is not None and param.place.is_cpu_place():
            raise NotImplementedError(
                f"{OP}: lr_ratio with {reason} on the CPU: Paddle's CPU AdamW would apply the "
                f"ratio to the weight decay only ({param.name})")
        if self._clip_coefficient is not None and _need_clip(param):
            grad = paddle.multiply(grad, self._clip_coefficient.astype(grad.dtype))  # Paddle's clip
        return super()._append_optimize_op(block, (param, grad))

    # --- the step: Paddle's, with the global-norm clip fused into the kernel -----------------
    def _clip_to_fuse(self, clip, pairs) -> bool:
        if type(clip) is not paddle.nn.ClipGradByGlobalNorm or self._optimizer_reason():
            return False
        if getattr(clip, "should_comm_on_shard_dim", False):
            return False
        try:
            from paddle.distributed.auto_parallel.fully_shard_fusion import get_fsdp_context

            if get_fsdp_context() is not None:
                return False
        except ImportError:
            pass
        return not any(g is not None and (_selected_rows(g) or p.is_dist()) for p, g in pairs)

    def apply_gradients(self, params_grads):
        # Paddle's apply_gradients (which the GradientMerge and Recompute wrappers call) runs the
        # update without _apply_optimize: the FP8 weight cache learns of it here.
        try:
            return super().apply_gradients(params_grads)
        finally:
            weights_changed(updated_parameters(params_grads))

    def _apply_optimize(self, loss, startup_program, params_grads, param_group_idx=0):
        try:
            return self._apply_optimize_fused_clip(loss, startup_program, params_grads, param_group_idx)
        finally:  # the FP8 weight cache re-quantises what changed (core/fp8/weight_cache.py)
            weights_changed(updated_parameters(params_grads))

    def _apply_optimize_fused_clip(self, loss, startup_program, params_grads, param_group_idx):
        grouped = isinstance(params_grads, dict)
        pairs = params_grads["params"] if grouped else params_grads
        clip = params_grads.get("grad_clip") if grouped else self._grad_clip
        if not self._clip_to_fuse(clip, pairs):
            return super()._apply_optimize(loss, startup_program, params_grads, param_group_idx)
        self._clip_coefficient = global_norm_clip_coefficient(clip, pairs)
        self._clip_coefficient_fp32 = core_optimizer.as_grad_scale(_BACKEND, self._clip_coefficient)
        saved_clip = self._grad_clip
        try:
            if grouped:
                params_grads = {**params_grads, "grad_clip": None}
            else:
                self._grad_clip = None
            return super()._apply_optimize(loss, startup_program, params_grads, param_group_idx)
        finally:
            self._grad_clip = saved_clip
            self._clip_coefficient = self._clip_coefficient_fp32 = None


def adamw_ref(param, grad, learning_rate, moment1, moment2, beta1_pow, beta2_pow,
              master_param=None, *, beta1: float = 0.9, beta2: float = 0.999,
              epsilon: float = 1e-8, weight_decay: float = 0.01, lr_ratio: float = 1.0,
              with_decay: bool = True, grad_scale=None, compute_dtype=paddle.float64):
    """Pure-Paddle reference of adamw_update_ (Paddle's CUDA formula) in compute_dtype (float32 or
    float64), out of place: returns (param, master_param or None, moment1, moment2, beta1_pow,
    beta2_pow) after one step, param in its own dtype, the rest in compute_dtype. The
    hyper-parameters are rounded to float32 first, as the kernels (Paddle's and ours) receive them.
    """
    def f(t):
        return t.astype(compute_dtype)

    def f32(v: float) -> float:
        return float(paddle.to_tensor(v, dtype=paddle.float32).item())

    beta1, beta2, epsilon = f32(beta1), f32(beta2), f32(epsilon)
    lr = f(learning_rate) * f32(lr_ratio)
    p = f(master_param if master_param is not None else param)
    g = f(grad) if grad_scale is None else f(grad) * f(grad_scale)
    p = p * (1.0 - lr * (f32(weight_decay) if with_decay else 0.0))
    m1 = beta1 * f(moment1) + (1.0 - beta1) * g
    m2 = beta2 * f(moment2) + (1.0 - beta2) * g * g
    denom = paddle.sqrt(m2) / paddle.sqrt(1.0 - f(beta2_pow)) + epsilon
    p = p + (m1 / denom) * (-(lr / (1.0 - f(beta1_pow))))
    return (p.astype(param.dtype), p if master_param is not None else None, m1, m2,
            f(beta1_pow) * beta1, f(beta2_pow) * beta2)
