"""The core layer's fused ops (paddle_fastffn/core) as torch autograd Functions over the C API's
kernels (c_api.py): the torch counterpart of paddle_fastffn.ops, the same classes the Paddle ops run
through their PyLayer adapter; only the backend differs (backend.py)."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import threading

import torch

import paddle_fastffn.core
from paddle_fastffn.core import ffn as core_ffn
from paddle_fastffn.core import linear_cross_entropy as core_lce
from paddle_fastffn.core import lora as core_lora
from paddle_fastffn.core.fp8.lm_head import sizes_error
from paddle_fastffn.core import residual as core_residual
from paddle_fastffn.core import rms_norm as core_rms_norm
from paddle_fastffn.core import rotary as core_rotary
from paddle_fastffn.core import swiglu as core_swiglu
from paddle_fastffn.core.autograd import FusedOp
from paddle_fastffn.torch.backend import TorchBackend, function
from paddle_fastffn.torch.c_api import Kernels, kernels

# --- the core layer's fused ops (paddle_fastffn/core), in torch's autograd -------------------------
# The same classes the Paddle ops run through their PyLayer adapter; only the backend differs.

BACKEND = TorchBackend(kernels, Kernels.empty)


def core_fused_ops() -> list[type[FusedOp]]:
    """Every FusedOp class defined in a module of paddle_fastffn/core, module by module (core/fp8's
    ops run over the FP8 backend: torch/fp8/)."""
    ops = []
    for info in pkgutil.iter_modules(paddle_fastffn.core.__path__):
        if info.ispkg:
            continue
        module = importlib.import_module(f"paddle_fastffn.core.{info.name}")
        ops += [value for value in vars(module).values()
                if inspect.isclass(value) and issubclass(value, FusedOp) and value is not FusedOp
                and value.__module__ == module.__name__]
    return ops


# Every core fused op as a torch Function over BACKEND, by its core class: a new op in core/ has its
# Function here with no edit (FUNCTIONS[core_foo.Foo].apply(...)). The names below are the ones the
# harness (llama.py, tests/gpu, benchmarks/gpu) calls.
FUNCTIONS = {op: function(op, BACKEND) for op in core_fused_ops()}

SwiGLU = FUNCTIONS[core_swiglu.SwiGLUPacked]  # apply(gate_up): packed [gate | up]
# apply(gate, up, reuse_input_memory): two inputs (the MLP with unfused gate_proj and up_proj, as
# under LoRA; reuse_input_memory writes the gradients over gate and up)
SwiGLUPair = FUNCTIONS[core_swiglu.SwiGLU]
RMSNorm = FUNCTIONS[core_rms_norm.RMSNorm]  # apply(x, weight, eps)
AddRMSNorm = FUNCTIONS[core_rms_norm.AddRMSNorm]  # apply(x, residual, weight, eps)
ResidualAdd = FUNCTIONS[core_residual.ResidualAdd]  # apply(residual, y): one gradient for both
# apply(x, weight, bias, lora_a, lora_b, scaling, fp8_base): a LoRA projection, base and adapter as one
# node (core/lora.py; weight None with a frozen FP8 base in fp8_base)
LoraLinear = FUNCTIONS[core_lora.LoraLinear]


# The core layer's rotary ops (paddle_fastffn/core/rotary.py), as the Paddle path runs them.
# Rotary.apply(q, k, cos, sin, position_ids): q/k may be token-strided views.
Rotary = FUNCTIONS[core_rotary.Rotary]
_QKVRotary = FUNCTIONS[core_rotary.QKVRotary]


def qkv_rotary(qkv, heads, kv_heads, cos, sin, position_ids=None):
    """ops.qkv_rotary's signature: PaddleNLP's interleaved fused qkv [b, s, kv_heads * (G + 2) * d]
    -> rotated q [b, s, heads, d], rotated k and v [b, s, kv_heads, d] (v a dense copy, see
    core/rotary.py), the backward writing one d_qkv. position_ids: None or int64 [b, s]; an
    out-of-table id is flagged on the device and raises when the step's flag is read."""
    if position_ids is not None:
        position_ids = position_ids.to(torch.int64).expand(qkv.shape[0], qkv.shape[1]).contiguous()
    return _QKVRotary.apply(qkv.contiguous(), cos, sin, position_ids, heads, kv_heads)


def fuse_qkv_weight(q_weight, k_weight, v_weight, heads, kv_heads):
    """PaddleNLP's fused qkv_proj layout in torch's [out, in] weights: per KV group its G query
    heads' rows, its k head's, its v head's (fuse_param_func(is_qkv=True) on the out axis)."""
    d = q_weight.shape[0] // heads
    groups = heads // kv_heads
    rest = tuple(q_weight.shape[1:])
    return torch.cat([q_weight.reshape(kv_heads, groups * d, *rest),
                      k_weight.reshape(kv_heads, d, *rest),
                      v_weight.reshape(kv_heads, d, *rest)], 1).reshape(-1, *rest)


def split_qkv_weight(weight, heads, kv_heads):
    """The inverse of fuse_qkv_weight: (q, k, v) rows (for comparing gradients with HF's)."""
    d = weight.shape[0] // (heads + 2 * kv_heads)
    groups = heads // kv_heads
    rest = tuple(weight.shape[1:])
    parts = weight.reshape(kv_heads, (groups + 2) * d, *rest).split([groups * d, d, d], 1)
    return tuple(p.reshape(-1, *rest) for p in parts)


_SwiGLUDownProj = FUNCTIONS[core_swiglu.SwiGLUDownProj]


class SwiGLUDownProj:
    """out = swiglu(gate_up) @ W_d^T: what the Paddle patch's MLP runs after its gate_up_fused_proj
    GEMM (ops.swiglu_down_proj with reuse_gate_up_memory: core.swiglu.SwiGLUDownProj). The
    harness's gate_up is always its own GEMM's private output, so the backward writes d_gate_up
    over it; with recompute only gate_up is kept and the recomputed SwiGLU output is written over
    d_hidden."""

    @staticmethod
    def apply(gate_up, w_down, recompute=True):
        return _SwiGLUDownProj.apply(gate_up, w_down, recompute, True)


FusedFFN = FUNCTIONS[core_ffn.FusedFFN]


def fused_ffn(x, w_gate_up, w_down, recompute=True, split_gemms=False):
    """The FFN composition (core.ffn.FusedFFN; torch Linear layout: w_gate_up [2I, H] =
    [W_gate; W_up], w_down [H, I]). split_gemms=False (one [T, 2I] GEMM) is the default because
    interleaved timing on the H200 found it faster or level at every shape, e.g. 7B: 2.55 vs 2.66
    ms at 2048 tokens, 10.18 vs 10.39 ms at 8192 (benchmarks/results/gpu_h200_run3_sweep.json at
    commit 8c5140e). Sequential timing that favoured the split layout at small T was drift
    (benchmarks/results/history/README.md at that commit)."""
    return FusedFFN.apply(x, w_gate_up, w_down, recompute, split_gemms)


# --- fused linear cross-entropy (core.linear_cross_entropy, as ops.linear_cross_entropy) ----------

def cross_entropy(logits, labels, ignore_index=-100, grad_scale=1.0, with_grad=True, error=None):
    """Kernels.cross_entropy on the harness's library (the per-chunk kernel, for kernel tests)."""
    return kernels().cross_entropy(logits, labels, ignore_index, grad_scale, with_grad, error)


LinearCrossEntropy = FUNCTIONS[core_lce.LinearCrossEntropy]


def labelled_rows(hidden2d, labels1d, ignore_index: int):
    """core.linear_cross_entropy.labelled_rows over torch: (hidden rows, labels, their count)."""
    return core_lce.labelled_rows(BACKEND, hidden2d, labels1d, ignore_index)


_FP8_HEAD_STATES = threading.local()  # by_key: this thread's heads (fp8_head)


def fp8_head(recipe, device):
    """The core's Fp8LmHead over the torch FP8 backend on `device`: the recipe's LM head states,
    made once per (formats, margin, device, thread) and reused (current scaling carries nothing from
    one call to the next: core/fp8/lm_head.py), as the Paddle op keeps them."""
    from paddle_fastffn.core.fp8.lm_head import Fp8LmHead
    from paddle_fastffn.torch.fp8.backend import TorchFp8Backend

    key = (recipe.forward_format, recipe.backward_format, recipe.margin, str(device))
    held = _FP8_HEAD_STATES.__dict__.setdefault("by_key", {})
    if key not in held:
        backend = TorchFp8Backend(device)
        held[key] = Fp8LmHead(backend, recipe.lm_head_states(backend))
    return held[key]


def linear_cross_entropy(hidden, weight, labels, ignore_index=-100, transpose_weight=False, chunk_tokens=None,
                         fp8_recipe=None):
    """hidden [T, H] (or [..., H]); weight [H, V] or, with transpose_weight, [V, H]; labels int64 [T]
    -> fp32 scalar loss (mean over tokens whose loss is > 0), never the [T, V] logits. Only the
    labelled rows reach the LM head (labelled_rows), as in the Paddle op; chunks default to the
    GPU budget (core.linear_cross_entropy.GPU_CHUNK_BYTES, GPU_FROZEN_HEAD_CHUNK_BYTES for a frozen
    head). fp8_recipe: the three GEMMs in FP8 (core/fp8/lm_head.py), bf16 or fp32 hidden, H and V
    multiples of 16."""
    fp8 = None
    if fp8_recipe is not None:
        width, vocab = (weight.shape[1], weight.shape[0]) if transpose_weight else weight.shape
        why_not = (f"the hidden states are {hidden.dtype}, not bf16 or fp32"
                   if hidden.dtype not in (torch.bfloat16, torch.float32) else sizes_error(width, vocab))
        if why_not is not None:
            raise ValueError(f"linear_cross_entropy: `hidden` and `weight` cannot run the FP8 LM head: {why_not}")
        fp8 = fp8_head(fp8_recipe, hidden.device)
    hidden2d, labels1d, n_labelled = labelled_rows(hidden.reshape(-1, hidden.shape[-1]),
                                                   labels.reshape(-1).long().contiguous(), ignore_index)
    vocab = weight.shape[0] if transpose_weight else weight.shape[1]
    chunk = chunk_tokens or core_lce.default_chunk_tokens(vocab, on_gpu=True, weight_trainable=weight.requires_grad)
    return LinearCrossEntropy.apply(hidden2d, weight, labels1d.contiguous(), ignore_index, transpose_weight,
                                    chunk, n_labelled, fp8)
