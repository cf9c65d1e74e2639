"""The steps of a LLaMA decoder layer, by name, and the C entry-point calls of its FP8 FFN: pure
data (no Paddle, no torch), read by both sides.

The step names are the steps of core/decoder.py, which both the Paddle patch
(integration/llama.py) and the GPU harness (paddle_fastffn/torch/llama.py, FastDecoderLayer)
execute: decoder.STEP_OF_PART names the step of each layer part that code calls, so a run of
core/decoder.py over recording parts gives exactly these lists (tests/integration/test_composition.py
checks that, and traces a patched PaddleNLP layer against the same lists).

A layer is the attention sub-layer's steps and the MLP sub-layer's steps between three steps of the
layer itself; each sub-layer has its variants (which one a layer takes is its framework side's
decision: fused projections or not, FP8 attached or not).
"""

# --- the attention sub-layer ----------------------------------------------------------------------
ATTENTION_FUSED = (
    "qkv_proj",          # one GEMM: PaddleNLP's fused qkv_proj, interleaved per KV group
    "rotary",            # q and k rotated in one kernel reading the QKV output through strides; v copied
    "attention",         # causal SDPA / flash attention, grouped-query heads natively
    "o_proj",
)
ATTENTION_UNFUSED = (    # q_proj / k_proj / v_proj: LoRA adapters, or a model built before enabling
    "q_proj",
    "k_proj",
    "v_proj",
    "rotary",            # q and k in one kernel
    "attention",
    "o_proj",
)

# --- the MLP sub-layer ----------------------------------------------------------------------------
MLP_FUSED = (
    "gate_up_proj",      # one GEMM: PaddleNLP's gate_up_fused_proj, packed [gate | up]
    "swiglu_down_proj",  # SwiGLU and the down GEMM; the SwiGLU output recomputed in backward
)
MLP_FUSED_STORED = (     # fused gate_up, but a down_proj that is not a plain Linear (or no recompute)
    "gate_up_proj",
    "swiglu",            # the SwiGLU output stored for the down projection's backward
    "down_proj",
)
MLP_UNFUSED = (
    "gate_proj",
    "up_proj",
    "swiglu",            # the two-input kernel: silu(gate) * up
    "down_proj",
)
MLP_FP8 = (
    "fp8_ffn",           # gate_up GEMM -> SwiGLU fused with quantising h -> down GEMM; h recomputed
)
MLP_VARIANTS = {"fused": MLP_FUSED, "fused_stored": MLP_FUSED_STORED, "unfused": MLP_UNFUSED, "fp8": MLP_FP8}
ATTENTION_VARIANTS = {"fused": ATTENTION_FUSED, "unfused": ATTENTION_UNFUSED}


def decoder_layer_steps(attention: str = "fused", mlp: str = "fused") -> tuple:
    """The steps of one decoder layer with the given sub-layer variants, in order."""
    return ("rms_norm",) + ATTENTION_VARIANTS[attention] + ("add_rms_norm",) + MLP_VARIANTS[mlp] + ("residual_add",)


# The fast path's defaults (`use_fast_ffn`): fused projections, SwiGLU recompute.
LLAMA_DECODER_LAYER = decoder_layer_steps("fused", "fused")
# fast_ffn_precision=fp8: qkv_proj and o_proj are FP8 linears (Paddle: fp8.Fp8Linear; torch:
# torch/fp8/linear.py), and the MLP is one FP8 FFN (Paddle: fp8/ffn.py; torch: torch/fp8/ffn.py) whose C
# entry-point calls are FP8_FFN_CALLS below.
LLAMA_DECODER_LAYER_FP8 = decoder_layer_steps("fused", "fp8")
# LoRA (paddlenlp.peft.LoRAModel on the fast path): unfuse_for_lora (integration/llama.py) splits the
# fused projections back into PaddleNLP's stock q/k/v_proj and gate_proj/up_proj before the adapters
# are placed, so each projection is its own layer, a LoRALinear where the targets reach it:
#   y = x @ W + (x @ A @ B) * scaling     W frozen, A [in, r], B [r, out], scaling = alpha / r
# (LoRALinear.forward's math, dropout on x before A), computed by core/lora.py on both sides (its
# LoraLinear op without dropout, lora_linear with): the second adapter GEMM accumulates into the base
# output with alpha = scaling (addmm, beta 1), no separate scale and add passes over [tokens, out]
# (Paddle: integration/lora_forward.py's
# forward on each LoRALinear, Fp8Linear's adapters under FP8; the harness in torch's [out, in]
# layout, x @ W^T + scaling * ((x @ A^T) @ B^T)). The MLP then runs the two-input SwiGLU kernel
# between gate_proj/up_proj and down_proj; swiglu_down_proj is not used (down_proj is a LoRALinear,
# not a plain Linear), so the SwiGLU output is stored for backward. Under fast_ffn_precision=fp8 the same steps run:
# attach_fp8 gives every one of these linears an Fp8Linear (the MLP is not the fused pair the FP8
# FFN needs), whose base GEMM runs in FP8 with the adapters in the activation dtype.
LLAMA_DECODER_LAYER_UNFUSED = decoder_layer_steps("unfused", "unfused")

# --- the FP8 FFN, call by call --------------------------------------------------------------------
# Stored FP8 copies: an activation or gradient [T, F] row-wise or transposed ([F, T], T padded to
# 16 in Paddle); a weight as [out, in] or [in, out] (torch stores [out, in], Paddle [in, out]:
# each framework's "as stored" copy is the other's transposed one).
ROWWISE, TRANSPOSED = "rowwise", "transposed"
OUT_IN, IN_OUT = "[out, in]", "[in, out]"

# One forward and backward of the FP8 FFN with every gradient needed, as (C entry point without
# its _cuda suffix, tensor, stored FP8 copies):
#   fp8_quantize, swiglu_*_fp8: the tensor quantised, and the (tensor, copy) pairs the call writes;
#   gemm: the product, and the (tensor, copy) pairs of its operands A and B. Listed in the C API's
#       default layout (torch's): Paddle's weight gradients are the transposes of torch's, so there
#       A and B trade places (compare GEMM operands unordered).
# The scale calls of the recipes are fp8_ffn_calls'.
FP8_FFN_FORWARD = (
    ("fp8_quantize", "x", (("x", ROWWISE), ("x", TRANSPOSED))),
    ("fp8_quantize", "w_gate_up", (("w_gate_up", OUT_IN), ("w_gate_up", IN_OUT))),  # weight cache:
    ("fp8_quantize", "w_down", (("w_down", OUT_IN), ("w_down", IN_OUT))),            # once a step
    ("gemm", "gate_up", (("x", ROWWISE), ("w_gate_up", OUT_IN))),                    # fast accum
    ("swiglu_fwd_fp8", "h", (("h", ROWWISE), ("gate_up", ROWWISE))),  # gate_up's copy: for backward
    ("gemm", "y", (("h", ROWWISE), ("w_down", OUT_IN))),                             # fast accum
)
FP8_FFN_BACKWARD = (
    ("fp8_quantize", "dy", (("dy", ROWWISE), ("dy", TRANSPOSED))),
    ("gemm", "d_h", (("dy", ROWWISE), ("w_down", IN_OUT))),
    ("swiglu_bwd_fp8", "d_gate_up", (("d_gate_up", ROWWISE), ("d_gate_up", TRANSPOSED),
                                     ("h", TRANSPOSED))),  # from gate_up's copy (saved_gate_up
                                                           # "fp8"); h recomputed, forward's scale
    ("gemm", "d_w_down", (("dy", TRANSPOSED), ("h", TRANSPOSED))),
    ("gemm", "d_x", (("d_gate_up", ROWWISE), ("w_gate_up", IN_OUT))),
    ("gemm", "d_w_gate_up", (("d_gate_up", TRANSPOSED), ("x", TRANSPOSED))),
)
FP8_FFN_CALLS = FP8_FFN_FORWARD + FP8_FFN_BACKWARD
WEIGHTS = ("w_gate_up", "w_down")


def fp8_ffn_calls(scaling: str, first_step: bool, delayed_warm_start: bool = True,
                  saved_gate_up: str = "fp8", weight_copies: str = "per_use") -> tuple:
    """FP8_FFN_CALLS with the calls of a recipe's scaling, for the FFN's first step (every state
    fresh) or a later one (the weight cache re-quantises the weights: an optimizer step was taken).
    A quantisation scaled by its tensor's own amax (the weights always; everything under current
    scaling, and under delayed scaling's warm start on the first step) is preceded by its kernel's
    amax-only pass (no copies written) and fp8_compute_scale; the SwiGLU forward's pass gives h's
    and gate_up's amax together (two fp8_compute_scale). Delayed scaling ends each tensor's step
    once its last use is over: x, h and gate_up after the forward, dy and d_gate_up after the
    backward (fp8_update_amax_history). saved_gate_up "activation" (Fp8Recipe): no FP8 copy of
    gate_up, the backward reads the 16-bit one. weight_copies "per_use" (Fp8Recipe): the forward
    writes only each weight's [out, in] copy, and the backward quantises its [in, out] copy just
    before the GEMM that reads it, with the forward's scale (no amax pass)."""
    own_amax = scaling == "current" or (first_step and delayed_warm_start)
    copy = saved_gate_up == "fp8"
    forward, backward = FP8_FFN_FORWARD, FP8_FFN_BACKWARD
    if weight_copies == "per_use":
        forward = tuple((kernel, tensor, ((tensor, OUT_IN),)) if kernel == "fp8_quantize" and tensor in WEIGHTS
                        else (kernel, tensor, writes) for kernel, tensor, writes in forward)
        backward = tuple(call for kernel, tensor, operands in backward
                         for call in [("fp8_quantize", w, ((w, IN_OUT),)) for w in WEIGHTS if (w, IN_OUT) in operands]
                         + [(kernel, tensor, operands)])

    def quantised_by(call) -> list:
        """The tensors whose scales a call's own-amax pass sets (h's pass: gate_up's copy too)."""
        kernel, tensor, writes = call
        return [tensor] + (["gate_up"] if ("gate_up", ROWWISE) in writes else [])

    def phase(steps, ending, weights_scaled_here: bool):
        calls = []
        for kernel, tensor, writes in steps:
            if not copy:
                writes = tuple(w for w in writes if w != ("gate_up", ROWWISE))
            call = (kernel, tensor, writes)
            if kernel != "gemm" and (own_amax and tensor not in WEIGHTS or tensor in WEIGHTS and weights_scaled_here):
                calls += [(kernel, tensor, ())] + [("fp8_compute_scale", t, ()) for t in quantised_by(call)]
            calls.append(call)
        if scaling == "delayed":
            calls += [("fp8_update_amax_history", tensor, ()) for tensor in ending]
        return calls

    forward_ending = ("x", "h", "gate_up") if copy else ("x", "h")
    return tuple(phase(forward, forward_ending, True) + phase(backward, ("dy", "d_gate_up"), False))


def comparable(calls) -> list:
    """Calls as both traces compare them (tests/integration/test_composition.py for Paddle,
    tests/gpu/test_fp8_ffn_composition.py for the harness): the copies of a call as a set (a pass
    writes its copies together), GEMMs named by their operands alone, unordered (Paddle's weight
    gradients are the transposes of the harness's, A and B exchanged)."""
    return [(kernel, tuple(sorted(rest[-1]))) if kernel == "gemm" else (kernel, rest[0], tuple(sorted(rest[1])))
            for kernel, *rest in calls]
