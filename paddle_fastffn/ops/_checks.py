"""Argument checks shared by the op wrappers: each error names the op, the argument and what was
expected, before anything reaches a kernel."""

from __future__ import annotations

import paddle

FLOAT_DTYPES = (paddle.float32, paddle.float16, paddle.bfloat16, paddle.float64)


def check_tensor(value, op: str, name: str) -> paddle.Tensor:
    if not isinstance(value, paddle.Tensor):
        raise TypeError(f"{op}: argument `{name}` must be a paddle.Tensor, got {type(value).__name__}")
    return value


def check_float(value, op: str, name: str) -> paddle.Tensor:
    check_tensor(value, op, name)
    if value.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{op}: argument `{name}` must be float32, float16, bfloat16 or float64, "
                        f"got {value.dtype}")
    return value


def check_like(reference: paddle.Tensor, ref_name: str, value, op: str, name: str,
               same_shape: bool = True) -> paddle.Tensor:
    check_float(value, op, name)
    if value.dtype != reference.dtype:
        raise TypeError(f"{op}: argument `{name}` must have the dtype of `{ref_name}` "
                        f"({reference.dtype}), got {value.dtype}")
    if same_shape and list(value.shape) != list(reference.shape):
        raise ValueError(f"{op}: argument `{name}` must have the shape of `{ref_name}` "
                         f"{list(reference.shape)}, got {list(value.shape)}")
    check_same_device(reference, ref_name, value, op, name)
    return value


def check_same_device(reference: paddle.Tensor, ref_name: str, value: paddle.Tensor, op: str,
                      name: str) -> None:
    if str(value.place) != str(reference.place):
        raise ValueError(f"{op}: argument `{name}` is on {value.place} but `{ref_name}` is on "
                         f"{reference.place}; move both to one device")


def kernel_supports_place(tensor: paddle.Tensor) -> bool:
    """The compiled kernels cover CPU (all four float dtypes), and CUDA GPUs when Paddle has CUDA
    (float32/float16/bfloat16: float64 exists for CPU gradient checks); others use *_ref."""
    place = tensor.place
    if place.is_cpu_place():
        return True
    return paddle.is_compiled_with_cuda() and place.is_gpu_place() and tensor.dtype != paddle.float64


def contiguous(tensor: paddle.Tensor) -> paddle.Tensor:
    return tensor if tensor.is_contiguous() else tensor.contiguous()


def remember_grad_needs(ctx, *tensors) -> None:
    """Record which PyLayer inputs want gradients; Paddle requires None for the others.

    Recorded in forward because a backward cannot ask its saved tensors: under non-reentrant
    recompute (PaddleNLP's default, `recompute_use_reentrant=false`) ctx.saved_tensor() returns
    the replay's detached copies, whose stop_gradient is True even for a trained weight."""
    ctx.grad_needs = [t is not None and not t.stop_gradient for t in tensors]


def needed_grads(ctx, *grads):
    """Gradients for the inputs recorded by remember_grad_needs, None where none is wanted."""
    out = tuple(g if need else None for g, need in zip(grads, ctx.grad_needs))
    return out[0] if len(out) == 1 else out
