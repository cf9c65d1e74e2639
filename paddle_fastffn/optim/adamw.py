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

import paddle
from paddle import _C_ops
from paddle.base import framework
from paddle.optimizer.lr import LRScheduler

from ..core import optimizer as core_optimizer

from ..ops import _checks
from ..ops._loader import run_op
from ..core.fp8.weight_cache import updated_parameters, weights_changed

OP = "paddle_fastffn.optim.adamw"
_KERNEL_DTYPES = (paddle.float32, paddle.float16, paddle.bfloat16)
_INFORMED: set[str] = set()


def _adamw_op(param, grad, learning_rate, moment1, moment2, beta1_pow, beta2_pow, master_param,
              grad_scale, beta1, beta2, epsilon, lr_ratio, coeff, with_decay) -> None:
    # detach: the same memory, without autograd's refusal to update a trainable leaf in place
    # (Paddle's own optimizer ops write parameters the same way, outside autograd).
    run_op("fastffn_adamw_", param.detach(), grad, learning_rate, moment1, moment2, beta1_pow, beta2_pow,
           master_param, grad_scale, float(beta1), float(beta2), float(epsilon), float(lr_ratio),
           float(coeff), bool(with_decay))


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


def _check_update_args(param, grad, learning_rate, moment1, moment2, beta1_pow, beta2_pow,
                       master_param, grad_scale) -> None:
    _checks.check_tensor(param, OP, "param")
    if param.dtype not in _KERNEL_DTYPES:
        raise TypeError(f"{OP}: argument `param` must be float32, float16 or bfloat16, got "
                        f"{param.dtype}")
    if not param.is_contiguous():
        raise ValueError(f"{OP}: argument `param` must be contiguous (it is updated in place)")
    _check_like_param(param, grad, "grad", (param.dtype, paddle.float32))
    _check_like_param(param, moment1, "moment1", (paddle.float32,))
    _check_like_param(param, moment2, "moment2", (paddle.float32,))
    if master_param is not None:
        _check_like_param(param, master_param, "master_param", (paddle.float32,))
    _check_scalar(learning_rate, "learning_rate")
    _check_scalar(beta1_pow, "beta1_pow")
    _check_scalar(beta2_pow, "beta2_pow")
    if grad_scale is not None:
        _check_scalar(grad_scale, "grad_scale")
    if not _checks.kernel_supports_place(param):
        raise ValueError(f"{OP}: no compiled kernel for parameters on {param.place}")


def adamw_update_(param, grad, learning_rate, moment1, moment2, beta1_pow, beta2_pow,
                  master_param=None, *, beta1: float = 0.9, beta2: float = 0.999,
                  epsilon: float = 1e-8, weight_decay: float = 0.01, lr_ratio: float = 1.0,
                  with_decay: bool = True, grad_scale=None) -> None:
    """One AdamW step of one tensor, in place (Paddle's ``_C_ops.adamw_`` for a dense gradient).

    param [any shape] float32/float16/bfloat16; grad: param's dtype or float32, same size;
    master_param (fp32, or None: the update is computed from param), moment1, moment2: float32,
    same size. learning_rate, beta1_pow (beta1^t at step t), beta2_pow, grad_scale (a gradient
    multiplier, e.g. the global-norm clip coefficient; None = 1): one-element float32 tensors on
    the CPU or on param's device. fp32 math -> param in its dtype. Afterwards beta1_pow and
    beta2_pow are multiplied by beta1 and beta2, as Paddle's kernel does.
    """
    _check_update_args(param, grad, learning_rate, moment1, moment2, beta1_pow, beta2_pow,
                       master_param, grad_scale)
    _adamw_op(param, grad, learning_rate, moment1, moment2, beta1_pow, beta2_pow, master_param,
              grad_scale, beta1, beta2, epsilon, lr_ratio, weight_decay, with_decay)


def _inform(reason: str) -> None:
    """Paddle's own update runs where the kernel does not apply: one info line per reason."""
    if reason not in _INFORMED:
        _INFORMED.add(reason)
        from paddlenlp.utils.log import logger

        logger.info(f"paddle_fastffn: FastAdamW: {reason}: those parameters take Paddle's own "
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

    def fill_(self, t, value):
        _C_ops.full_(t, list(t.shape), float(value), t.dtype, t.place)

    def adamw(self, update, learning_rate, grad_scale, hyper):
        _adamw_op(update.param, update.grad, learning_rate, update.moment1, update.moment2, update.beta1_pow,
                  update.beta2_pow, update.master, grad_scale, hyper.beta1, hyper.beta2, hyper.epsilon,
                  update.lr_ratio, hyper.weight_decay, update.with_decay)


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
    """

    def __init__(self, learning_rate=0.001, beta1=0.9, beta2=0.999, epsilon=1e-8, parameters=None,
                 weight_decay=0.01, use_lowprecision_moment=False, lr_ratio=None,
                 apply_decay_param_fun=None, grad_clip=None, lazy_mode=False,
                 multi_precision=False, amsgrad=False, name=None):
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
        if moment1.dtype != paddle.float32:
            return "low-precision moments (use_lowprecision_moment)"
        if learning_rate.dtype != paddle.float32:
            return f"a {learning_rate.dtype} learning rate"
        if param.is_dist():
            return "distributed (DistTensor) parameters"
        if not _checks.kernel_supports_place(param):
            return f"parameters on {param.place}"
        return None

    # --- one parameter's update -------------------------------------------------------------
    def _append_optimize_op(self, block, param_and_grad):
        if isinstance(param_and_grad, dict):
            param_and_grad = self._update_param_group(param_and_grad)
        param, grad = param_and_grad
        reason = self._optimizer_reason()
        if reason is not None:
            return self._paddle_update(block, param, grad, reason)
        moment1 = self._get_accumulator_master(self._moment1_acc_str, param)
        learning_rate = self._create_param_lr((param, grad))
        reason = self._parameter_reason(param, grad, moment1, learning_rate)
        if reason is not None:
            return self._paddle_update(block, param, grad, reason)
        find_master = self._multi_precision and self._is_dtype_fp16_or_bf16(param.dtype)
        clipped = self._clip_coefficient_fp32 is not None and _need_clip(param)
        update = core_optimizer.ParameterUpdate(
            param, grad, moment1, self._get_accumulator_master(self._moment2_acc_str, param),
            self._master_weights[param.name] if find_master else None,
            self._get_accumulator_master(self._beta1_pow_acc_str, param),
            self._get_accumulator_master(self._beta2_pow_acc_str, param),
            lr_ratio=1.0 if self._lr_ratio is None else self._lr_ratio(param),
            with_decay=self._apply_decay_param_fun is None or self._apply_decay_param_fun(param.name),
            clipped=clipped)
        hyper = core_optimizer.AdamWHyper(_as_float(self._beta1), _as_float(self._beta2), _as_float(self._epsilon),
                                          float(self._weight_decay))
        core_optimizer.update_parameters(_BACKEND, [update], learning_rate, self._clip_coefficient_fp32, hyper)
        return None

    def _paddle_update(self, block, param, grad, reason):
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
