"""The GPU harness's host Python per FP8 linear and per AdamW parameter, counted on a machine without
a GPU. The FP8 LoRA step is host-bound (profile_step's host profile: the GPU waits for the host's
Python), and this is the part of that host time which a change to the binding (c_api.py,
fp8/c_api.py, fp8/backend.py, optimizer.py) or to the shared core (paddle_fastffn/core) moves:

    PYTHONPATH=. python -m benchmarks.gpu.host_calls [--scaling delayed] [--weight frozen] [--top 25]

The harness's own code runs, the GPU binding's Fp8Kernels and Kernels included, over a stand-in
library whose C entry points return success without running anything, on CPU tensors, under
cProfile: its count of calls (Python functions and C builtins) per FP8 linear forward + backward
and per parameter update of FusedMasterAdamW's step is what the GPU step's host executes in Python
for them; the C entry points' own work and the torch ops' device work are not in it. torch's
stream query is stood in for at its C layer (device count, index, stream; the Stream object), so its Python
is counted as it runs on a GPU machine. tests/torch_cpu/test_host_calls.py keeps the counts under
ceilings.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import pstats
from unittest import mock

import torch

from paddle_fastffn.torch import c_api
from paddle_fastffn.torch.fp8 import c_api as fp8_c_api


class _EntryPoint:
    """A C entry point that returns status 0 at once (ctypes' argtypes and restype may be set),
    appending (its name, its arguments) to `calls` when given one."""

    def __init__(self, name: str, calls: list | None):
        self.name, self.calls = name, calls
        self.argtypes = self.restype = None

    def __call__(self, *args):
        if self.calls is not None:
            self.calls.append((self.name, args))
        return 0


class StandInLibrary:
    """Every fastffn_* function of the kernels' library, as an _EntryPoint made on first use;
    `calls` records every call (tests read the descriptors the binding passes)."""

    def __init__(self, calls: list | None = None):
        self._calls = calls

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        entry = _EntryPoint(name, self._calls)
        setattr(self, name, entry)
        return entry


class _StandInStream:
    """torch.cuda.Stream as torch.cuda.current_stream builds it, on object instead of the driver's
    stream class: the same Python (its __new__, torch.backends.cuda.is_built) and one builtin
    __new__ call, the default stream's null handle."""

    def __new__(cls, device=None, priority=0, **kwargs):
        if not torch.backends.cuda.is_built():
            raise RuntimeError("torch.cuda.Stream requires CUDA support")
        if device is None or ("stream_id" in kwargs and "device_index" in kwargs):
            stream = object.__new__(cls)
            stream.cuda_stream = 0
            return stream
        raise NotImplementedError("host_calls: only the current stream is stood in for")


@contextlib.contextmanager
def stand_in_kernels(calls: list | None = None):
    """c_api.kernels() and fp8_c_api.kernels() are the GPU binding's classes over a StandInLibrary
    (recording into `calls` when given) for the block, and torch's CUDA stream query answers
    device 0, its default stream."""
    lib = StandInLibrary(calls)
    kernels = c_api.Kernels.__new__(c_api.Kernels)  # __init__ loads the real library
    kernels.lib = lib
    with mock.patch.object(fp8_c_api, "check_abi", lambda _: None):
        fp8_kernels = fp8_c_api.Fp8Kernels(lib)
    c = torch._C
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(c_api, "_KERNELS", kernels))
        stack.enter_context(mock.patch.object(fp8_c_api, "_KERNELS", fp8_kernels))
        stack.enter_context(mock.patch.object(torch.cuda, "_lazy_init", lambda: None))
        stack.enter_context(mock.patch.object(torch.cuda, "Stream", _StandInStream))
        for name, stand_in in (("_cuda_getDeviceCount", lambda: 1), ("_cuda_getDevice", lambda: 0),
                               ("_cuda_getCurrentStream", lambda device: (0, 0, 1)),
                               ("_cuda_getCurrentRawStream", lambda device: 0)):
            stack.enter_context(mock.patch.object(c, name, stand_in, create=True))
        yield


def _count(run) -> tuple[int, pstats.Stats]:
    profile = cProfile.Profile()
    profile.enable()
    run()
    profile.disable()
    stats = pstats.Stats(profile)
    return stats.total_calls, stats


def _count_after_warm_up(step, tokens: int, width: int) -> tuple[int, pstats.Stats]:
    """_count of step(x, dy) on bf16 [tokens, width] inputs, after two warm-up steps (delayed
    scaling's warm start) on inputs of their own."""
    inputs = [(torch.randn(tokens, width, dtype=torch.bfloat16, requires_grad=True),
               torch.randn(tokens, width, dtype=torch.bfloat16)) for _ in range(3)]
    step(*inputs[0])
    step(*inputs[1])
    return _count(lambda: step(*inputs[2]))


def fp8_linear_calls(scaling: str = "delayed", weight: str = "frozen", linears: int = 32, width: int = 64,
                     tokens: int = 64) -> tuple[float, pstats.Stats]:
    """(Python calls per FP8 linear forward + backward, the stats): a chain of `linears` FP8
    linears [tokens, width] -> [tokens, width] and one backward through all of them, after two
    warm-up steps (delayed scaling's warm start). weight: "frozen" (a FrozenFp8Weight, forward
    copy only: the LoRA base), "frozen_both" (both copies) or "trained" (a weight with a gradient,
    quantised per use)."""
    from paddle_fastffn.core.fp8.recipe import Fp8Recipe
    from paddle_fastffn.torch.fp8.linear import Fp8LinearState, fp8_linear, freeze_weight

    with stand_in_kernels():
        recipe = Fp8Recipe(scaling=scaling)
        states = [Fp8LinearState(recipe, "cpu") for _ in range(linears)]
        weights = [torch.randn(width, width, dtype=torch.bfloat16, requires_grad=weight == "trained")
                   for _ in range(linears)]
        if weight != "trained":
            weights = [freeze_weight(w, s, both_copies=weight == "frozen_both") for w, s in zip(weights, states)]

        def step(x, dy):
            y = x
            for w, s in zip(weights, states):
                y = fp8_linear(y, w, s)
            y.backward(dy)

        calls, stats = _count_after_warm_up(step, tokens, width)
    return calls / linears, stats


def lora_projection_calls(one_node: bool = True, projections: int = 32, width: int = 64, tokens: int = 64,
                          rank: int = 8) -> tuple[float, pstats.Stats]:
    """(Python calls per LoRA projection forward + backward, the stats): a chain of `projections`
    LoRA projections over frozen FP8 bases (FrozenFp8Weight, delayed scaling: the FP8 LoRA step's
    projections) and one backward through all of them, after two warm-up steps. one_node: the
    LoraLinear op (core/lora.py, what the harness runs); else the FP8 linear followed by
    lora_linear (its three GEMM nodes and autograd's sum of x's two gradients)."""
    from paddle_fastffn.core.fp8.recipe import Fp8Recipe
    from paddle_fastffn.core.lora import lora_linear
    from paddle_fastffn.torch import ops
    from paddle_fastffn.torch.fp8.linear import Fp8LinearState, fp8_linear, freeze_weight, fp8_base_of

    with stand_in_kernels():
        states = [Fp8LinearState(Fp8Recipe(scaling="delayed"), "cpu") for _ in range(projections)]
        bases = [freeze_weight(torch.randn(width, width, dtype=torch.bfloat16), s) for s in states]
        adapters = [(torch.randn(rank, width, dtype=torch.bfloat16, requires_grad=True),
                     torch.randn(width, rank, dtype=torch.bfloat16, requires_grad=True)) for _ in range(projections)]

        def step(x, dy):
            y = x
            for base, state, (a, b) in zip(bases, states, adapters):
                if one_node:
                    y = ops.LoraLinear.apply(y, None, None, a, b, 2.0, fp8_base_of(y, base, state))
                else:
                    y = lora_linear(ops.BACKEND, y, fp8_linear(y, base, state), a, b, 2.0)
            y.backward(dy)

        calls, stats = _count_after_warm_up(step, tokens, width)
    return calls / projections, stats


def adamw_calls(params: int = 32, numel: int = 256) -> tuple[float, pstats.Stats]:
    """(Python calls per parameter of FusedMasterAdamW.step, the stats): bf16 parameters with fp32
    masters and moments, no clip, after one warm-up step."""
    from paddle_fastffn.torch.llama import FusedMasterAdamW

    with stand_in_kernels():
        weights = [torch.zeros(numel, dtype=torch.bfloat16, requires_grad=True) for _ in range(params)]
        for w in weights:
            w.grad = torch.zeros_like(w)
        optimizer = FusedMasterAdamW(weights)
        optimizer.step()
        calls, stats = _count(optimizer.step)
    return calls / params, stats


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scaling", default="delayed", choices=("delayed", "current"))
    parser.add_argument("--weight", default="frozen", choices=("frozen", "frozen_both", "trained"))
    parser.add_argument("--top", type=int, default=25, help="functions with the most calls to list")
    args = parser.parse_args()
    per_linear, stats = fp8_linear_calls(args.scaling, args.weight)
    print(f"FP8 linear forward + backward ({args.scaling} scaling, {args.weight} weight): "
          f"{per_linear:.1f} Python calls")
    stats.sort_stats("ncalls").print_stats(args.top)
    for one_node in (True, False):
        per_projection, stats = lora_projection_calls(one_node)
        print(f"LoRA projection over a frozen FP8 base, forward + backward, "
              f"{'LoraLinear' if one_node else 'FP8 linear + lora_linear'}: {per_projection:.1f} Python calls")
        stats.sort_stats("ncalls").print_stats(args.top)
    per_param, stats = adamw_calls()
    print(f"FusedMasterAdamW.step: {per_param:.1f} Python calls per parameter")
    stats.sort_stats("ncalls").print_stats(args.top)


if __name__ == "__main__":
    main()
