"""The Paddle patch runs the decoder layer that the GPU benchmark times: a traced forward of a
patched PaddleNLP LLaMA follows paddle_fastffn/integration/composition.py step by step, the list
that benchmarks/gpu/llama_model.py's FastDecoderLayer executes. If either side changes its
composition, this test (or the GPU test of the benchmarked layer) fails."""

import paddle

import paddle_fastffn
from llama_fixtures import batch, tiny_model
from paddle_fastffn import ops
from paddle_fastffn.integration.composition import LLAMA_DECODER_LAYER
from paddle_fastffn.ops import _loader

KERNEL_STEPS = {"fastffn_rms_norm_fwd": "rms_norm", "fastffn_rotary": "rotary"}


def traced_forward(model, ids, monkeypatch):
    """The composition steps a forward runs, in order."""
    from paddlenlp.transformers.llama import modeling

    steps = []

    def on_kernel(name, args):
        if name == "fastffn_rms_norm_fwd":
            steps.append("add_rms_norm" if args[1] is not None else "rms_norm")
        elif name in KERNEL_STEPS:
            steps.append(KERNEL_STEPS[name])
        elif not (steps and steps[-1] == "swiglu_down_proj" and name == "fastffn_swiglu_fwd"):
            steps.append(name)  # a kernel the composition does not name: the comparison fails

    class Recorder:  # stands in for _loader.CALL_LOG's list
        def append(self, item):
            on_kernel(*item)

    def record(step, function):
        def wrapped(*args, **kwargs):
            steps.append(step)
            return function(*args, **kwargs)
        return wrapped

    monkeypatch.setattr(_loader, "CALL_LOG", Recorder())
    monkeypatch.setattr(modeling, "scaled_dot_product_attention",
                        record("attention", modeling.scaled_dot_product_attention))
    monkeypatch.setattr(ops, "swiglu_down_proj", record("swiglu_down_proj", ops.swiglu_down_proj))
    for layer in model.llama.layers:
        for step, sublayer in (("qkv_proj", layer.self_attn.qkv_proj), ("o_proj", layer.self_attn.o_proj),
                               ("gate_up_proj", layer.mlp.gate_up_fused_proj)):
            sublayer.register_forward_post_hook(lambda _layer, _inputs, _out, step=step: steps.append(step))
    with paddle.no_grad():
        model(ids)
    return steps


def test_patched_layers_follow_the_composition_the_benchmark_runs(monkeypatch):
    paddle_fastffn.apply_fast_ffn_to_llama()  # the defaults of use_fast_ffn, before the model is built
    model = tiny_model()
    ids, _, _ = batch()
    steps = traced_forward(model, ids, monkeypatch)
    # residual_add is a plain add (no kernel): it shows as the next layer (and the final norm)
    # starting from a plain rms_norm, not from a norm fused with the residual.
    per_layer = [step for step in LLAMA_DECODER_LAYER if step != "residual_add"]
    assert LLAMA_DECODER_LAYER[-1] == "residual_add"
    assert steps == per_layer * len(model.llama.layers) + ["rms_norm"], steps
