"""The LLaMA decoder layer, written once: the Paddle patch (integration/llama.py) and the GPU harness
(paddle_fastffn/torch/llama.py, FastDecoderLayer) both execute these functions, so the order of the
steps, the views each fused op is handed and what is dropped when are the same on both sides.
decoder_steps.py names the steps; STEP_OF_PART below says which step each part call is.

What a side supplies is a "layer parts" object: the framework plumbing of one layer (its own
sub-layers, autograd, recompute, stand-ins). Every tensor method takes and returns that framework's
tensors; shapes are [batch, seq, ...]. A side implements the methods of the variants it runs.

Layer (decoder_layer):
    input_norm(x) -> x                       rms_norm: the input RMSNorm
    self_attention(x) -> a [b, s, hidden]    runs attention(be, attention_parts, x) where the framework
                                             runs its attention sub-layer (Paddle: through the layer's
                                             self_attn, under PaddleNLP's full_attn recompute when on)
    post_norm_add(a, residual) -> (x, residual)   add_rms_norm: residual + a fused into the norm
    mlp(x) -> y                              runs mlp(mlp_parts, x, variant) likewise (Paddle: the
                                             layer's own mlp sub-layer call)
    residual_add(residual, y) -> out         residual_add: core/residual.py's ResidualAdd
Attention sub-layer (attention); attributes num_heads, num_kv_heads, head_dim, variant ("fused" or
"unfused", decoder_steps.ATTENTION_VARIANTS):
    qkv(x) -> [b, s, (h + 2 hk) d]           qkv_proj: the fused projection through the layer's own
                                             Linear (its LoRA / FP8 / tensor-parallel forward stays its)
    qkv_rotary(qkv) -> (q, k, v)             rotary: qkv in PaddleNLP's interleaved fused layout (per
                                             KV group its h/hk query heads, then k, then v) read through
                                             the kernel's strides; q [b, s, h, d] and k [b, s, hk, d]
                                             rotated, v [b, s, hk, d] a dense copy; the backward writes
                                             one d_qkv (no split copies, no concat)
    q(x), k(x), v(x) -> [b, s, heads * d]    q_proj / k_proj / v_proj (the unfused variant)
    rotary(q, k) -> (q, k)                   rotary on [b, s, heads, d] views (the unfused variant)
    attention(q, k, v) -> [b, s, h * d]      attention: causal, grouped-query heads natively; the side
                                             applies its mask (dense, packed segments) and core_attn
                                             recompute
    o_proj(a) -> [b, s, hidden]              o_proj
MLP sub-layer (mlp); variant from decoder_steps.MLP_VARIANTS:
    gate_up(x) -> [b, s, 2 I]                gate_up_proj: packed [gate | up]
    swiglu_down(gate_up) -> y                swiglu_down_proj: SwiGLU output recomputed in backward,
                                             gate_up's memory reused for its gradient
    gate(x), up(x) -> [b, s, I]              gate_proj / up_proj (the unfused variant)
    swiglu(gate_up) / swiglu(gate, up) -> h  swiglu: stored for down's backward (two inputs: gate's and
                                             up's memory then holds their gradients)
    down(h) -> y                             down_proj
    fp8_ffn(x) -> y                          fp8_ffn: the whole MLP as one FP8 FFN

The backend (core.backend.Backend) supplies the views: `shape` and `reshape`.
"""

from __future__ import annotations

STEP_OF_PART = {
    "input_norm": "rms_norm", "post_norm_add": "add_rms_norm", "residual_add": "residual_add",
    "qkv": "qkv_proj", "qkv_rotary": "rotary", "q": "q_proj", "k": "k_proj", "v": "v_proj", "rotary": "rotary",
    "attention": "attention", "o_proj": "o_proj",
    "gate_up": "gate_up_proj", "swiglu_down": "swiglu_down_proj", "gate": "gate_proj", "up": "up_proj",
    "swiglu": "swiglu", "down": "down_proj", "fp8_ffn": "fp8_ffn",
}


def decoder_layer(parts, hidden):
    """One decoder layer: hidden [b, s, hidden] -> [b, s, hidden]. The attention output is added to
    the residual inside the post-attention norm (one pass), so the residual stream is written once
    per sub-layer."""
    x = parts.input_norm(hidden)
    a = parts.self_attention(x)
    x, residual = parts.post_norm_add(a, hidden)
    del a
    return parts.residual_add(residual, parts.mlp(x))


def attention(be, parts, x):
    """The attention sub-layer: x [b, s, hidden] (normalised) -> [b, s, hidden]."""
    b, s = be.shape(x)[:2]
    h, hk, d = parts.num_heads, parts.num_kv_heads, parts.head_dim
    if parts.variant == "fused":
        # PaddleNLP's fused layout read in place: the rotary op reads q and k through its strides
        # and copies v, so the projection output is not kept (the backward writes d_qkv from d_q,
        # d_k and d_v alone).
        q, k, v = parts.qkv_rotary(parts.qkv(x))
    elif parts.variant == "unfused":
        q = be.reshape(parts.q(x), [b, s, h, d])
        k = be.reshape(parts.k(x), [b, s, hk, d])
        v = be.reshape(parts.v(x), [b, s, hk, d])
        q, k = parts.rotary(q, k)
    else:
        raise ValueError(f"attention: variant must be 'fused' or 'unfused', got {parts.variant!r}")
    a = parts.attention(q, k, v)
    del q, k, v
    return parts.o_proj(a)


def mlp(parts, x, variant: str):
    """The MLP sub-layer: x [b, s, hidden] (normalised) -> [b, s, hidden]; `variant` is a key of
    decoder_steps.MLP_VARIANTS."""
    if variant == "fused":
        return parts.swiglu_down(parts.gate_up(x))
    if variant == "fused_stored":
        return parts.down(parts.swiglu(parts.gate_up(x)))
    if variant == "unfused":
        gate = parts.gate(x)
        return parts.down(parts.swiglu(gate, parts.up(x)))
    if variant == "fp8":
        return parts.fp8_ffn(x)
    raise ValueError(f"mlp: variant must be one of 'fused', 'fused_stored', 'unfused', 'fp8', got {variant!r}")
