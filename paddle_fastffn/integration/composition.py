"""The decoder layer's step lists and the FP8 FFN's C calls, as the integration layer and its tests
name them. The data lives in paddle_fastffn/core/decoder_steps.py (beside core/decoder.py, the code
whose steps they name); this module keeps the names other code imports. An absolute import: the GPU
harness may load this file by path (no Paddle there; paddle_fastffn.core imports without it)."""

from paddle_fastffn.core.decoder_steps import (  # noqa: F401
    ATTENTION_FUSED, ATTENTION_UNFUSED, ATTENTION_VARIANTS, FP8_FFN_BACKWARD, FP8_FFN_CALLS, FP8_FFN_FORWARD,
    IN_OUT, LLAMA_DECODER_LAYER, LLAMA_DECODER_LAYER_FP8, LLAMA_DECODER_LAYER_UNFUSED, MLP_FP8, MLP_FUSED,
    MLP_FUSED_STORED, MLP_UNFUSED, MLP_VARIANTS, OUT_IN, ROWWISE, TRANSPOSED, WEIGHTS, comparable,
    decoder_layer_steps, fp8_ffn_calls)
