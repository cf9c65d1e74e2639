"""LoRALinear's forward on the fast path, for every model family: each PaddleNLP or PaddleFormers
LoRALinear inside a patched model's decoder layers gets an instance-level `forward` (shadowing the
class's, as fp8_attach gives a Linear its Fp8Linear) computing the projection as core/lora.py does,
the composition the GPU harness runs: with LoRA's dropout off (PaddleNLP's default) the LoraLinear
op, base and adapter as one node whose x gradient is one tensor; with dropout lora_linear. Either
way the adapter's second GEMM accumulates into the base output with alpha = scaling, where the
stock forward scales the adapter's [tokens, out] product and adds it in two more passes (and
scales again in backward).

No class is patched, so LoRA layers of models the plugin did not patch keep the stock forward, and
detach_all_lora_forwards (revert_fast_ffn) removes every attachment. Layers under FP8 are left to
their Fp8Linear, which computes its projection through the same two forms, the base in FP8. The
stock forward runs instead wherever its semantics are not this one's (stock_forward_needed)."""

from __future__ import annotations

import weakref

import paddle.nn.functional as F

from ..core.lora import fused_applies, lora_linear
from ..ops.lora_linear import lora_linear_fused
from ..ops._backend import BACKEND
from .fp8_attach import fp8_of, lora_linear_class

# The LoRA layers whose own forward is a FusedLoRAForward (detach_all_lora_forwards detaches them).
LORA_LAYERS: "weakref.WeakSet" = weakref.WeakSet()


def stock_forward_needed(layer, x) -> bool:
    """Where LoRALinear.forward computes something else than base + adapter, or where the addmm
    cannot run: weights merged (the adapters are inside the weight) or LoRA disabled (PaddleFormers'
    disable_lora): the base alone; PaddleNLP's use_quick_lora: its own fused autograd function;
    PiSSA before its first forward: stock initialises it there (the calls after run fused); a
    16-bit input on the CPU, where Paddle has no 16-bit matmul or addmm (stock's error stays its).
    LoRA's dropout is not among them: it drops x before A in both, the same one draw."""
    if layer.merged or getattr(layer, "disable_lora", False) or getattr(layer, "use_quick_lora", False):
        return True
    if getattr(layer, "pissa", False) and not getattr(layer, "apply_pissa", False):
        return True
    return x.place.is_cpu_place() and BACKEND.gemm_dtype(x) != x.dtype


class FusedLoRAForward:
    """A LoRALinear's forward: core/lora.py's LoraLinear (base and adapter as one node) where
    fused_applies (no dropout, one dtype, no bias), else its frozen Linear (bias included) plus
    lora_linear of its dropped input; the class's own forward where stock_forward_needed. Takes and returns what
    LoRALinear.forward does (x [..., in] -> [..., out])."""

    def __init__(self, layer):
        self.layer = layer

    def __call__(self, x, *args, **kwargs):
        layer = self.layer
        if stock_forward_needed(layer, x):
            return type(layer).forward(layer, x, *args, **kwargs)
        dropped = layer.lora_dropout(x)
        if fused_applies(BACKEND, x, dropped, layer.weight, layer.bias, layer.lora_A, layer.lora_B):
            return lora_linear_fused(x, layer.weight, layer.lora_A, layer.lora_B, layer.scaling)
        base = F.linear(x=x, weight=layer.weight, bias=layer.bias, name=layer.name)
        return lora_linear(BACKEND, dropped, base, layer.lora_A, layer.lora_B, layer.scaling)


def attach_lora_forwards(decoder_layers) -> int:
    """Give each LoRALinear under `decoder_layers` (that exact class: tensor-parallel and other
    subclasses compute otherwise and keep theirs) a FusedLoRAForward, unless an Fp8Linear computes it;
    returns how many layers have one."""
    lora_class = lora_linear_class()
    if lora_class is None:
        return 0
    count = 0
    for decoder_layer in decoder_layers:
        for layer in decoder_layer.sublayers():
            if type(layer) is not lora_class or fp8_of(layer) is not None:
                continue
            if not isinstance(layer.__dict__.get("forward"), FusedLoRAForward):
                layer.__dict__["forward"] = FusedLoRAForward(layer)
                LORA_LAYERS.add(layer)
            count += 1
    return count


def detach_lora_forward(layer) -> None:
    if isinstance(layer.__dict__.get("forward"), FusedLoRAForward):
        del layer.__dict__["forward"]
    LORA_LAYERS.discard(layer)


def detach_all_lora_forwards() -> None:
    for layer in list(LORA_LAYERS):
        detach_lora_forward(layer)
