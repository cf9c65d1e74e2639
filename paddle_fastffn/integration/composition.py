"""The steps of a LLaMA decoder layer on the fast path (the defaults of `use_fast_ffn`), in order.

One list for both sides: the Paddle patch (integration/llama.py) runs these steps, which
tests/integration/test_composition.py checks by tracing a patched layer; the GPU benchmark's
decoder layer (benchmarks/gpu/llama_model.py, FastDecoderLayer) executes exactly this list, so the
layer that is benchmarked is the layer users run. Pure data (no Paddle, no torch): the GPU machine
reads it by path.
"""

LLAMA_DECODER_LAYER = (
    "rms_norm",          # input_layernorm
    "qkv_proj",          # one GEMM: PaddleNLP's fused qkv_proj
    "rotary",            # q and k in one kernel, read as strided views of the QKV output
    "attention",         # causal SDPA / flash attention, grouped-query heads natively
    "o_proj",
    "add_rms_norm",      # the attention residual add fused into post_attention_layernorm
    "gate_up_proj",      # one GEMM: PaddleNLP's gate_up_fused_proj, packed [gate | up]
    "swiglu_down_proj",  # SwiGLU and the down GEMM; the SwiGLU output recomputed in backward
    "residual_add",      # a plain add: PaddleNLP's layer returns hidden states, not (h, residual)
)
