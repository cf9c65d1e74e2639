"""The Paddle patch runs the decoder layer that the GPU benchmark times: a traced forward of a
patched PaddleNLP LLaMA follows paddle_fastffn/integration/composition.py step by step, the list
that paddle_fastffn/torch/llama.py's FastDecoderLayer executes. If either side changes its
composition, this test (or the GPU test of the benchmarked layer) fails."""

import numpy as np
import paddle
import pytest

import paddle_fastffn
from llama_fixtures import batch, tiny_model
from paddle_fastffn import ops
from paddle_fastffn.fp8 import FP8_DTYPES, Fp8FFN, Fp8Recipe, WeightCache, fp8_ffn_cuda
from paddle_fastffn.fp8 import cuda as fp8_cuda
from paddle_fastffn.core import decoder
from paddle_fastffn.integration.composition import (ATTENTION_VARIANTS, IN_OUT, LLAMA_DECODER_LAYER,
                                                    LLAMA_DECODER_LAYER_FP8, LLAMA_DECODER_LAYER_UNFUSED,
                                                    MLP_VARIANTS, OUT_IN, ROWWISE, TRANSPOSED, comparable,
                                                    decoder_layer_steps, fp8_ffn_calls)
from paddle_fastffn.integration.llama import fp8_layers
from paddle_fastffn.ops import _loader


class RecordingParts:
    """Layer, attention and MLP parts at once that record the step of each part core.decoder calls
    (decoder.STEP_OF_PART) and return arrays of the shape the protocol promises, so the core's
    reshapes run on them."""

    num_heads, num_kv_heads, head_dim, hidden = 4, 2, 3, 12

    def __init__(self, attention_variant, mlp_variant):
        self.variant, self.mlp_variant, self.steps = attention_variant, mlp_variant, []
        for part, step in decoder.STEP_OF_PART.items():
            if not hasattr(self, part):
                setattr(self, part, self._recorder(step))

    def _recorder(self, step):
        def part(*tensors):
            self.steps.append(step)
            return tensors[0] if len(tensors) == 1 else tensors
        return part

    def _width(self, step, x, width):
        self.steps.append(step)
        return np.zeros(x.shape[:2] + (width,), np.float32)

    def qkv(self, x):
        return self._width("qkv_proj", x, (self.num_heads + 2 * self.num_kv_heads) * self.head_dim)

    def qkv_rotary(self, qkv):
        self.steps.append("rotary")
        b, s, width = qkv.shape
        hk = self.num_kv_heads
        assert width == (self.num_heads + 2 * hk) * self.head_dim, qkv.shape
        return (np.zeros((b, s, self.num_heads, self.head_dim)), np.zeros((b, s, hk, self.head_dim)),
                np.zeros((b, s, hk, self.head_dim)))

    def q(self, x):
        return self._width("q_proj", x, self.num_heads * self.head_dim)

    def k(self, x):
        return self._width("k_proj", x, self.num_kv_heads * self.head_dim)

    def v(self, x):
        return self._width("v_proj", x, self.num_kv_heads * self.head_dim)

    def attention(self, q, k, v):
        assert q.shape[2:] == (self.num_heads, self.head_dim) and k.shape == v.shape, (q.shape, k.shape, v.shape)
        return self._width("attention", q, self.num_heads * self.head_dim)

    def post_norm_add(self, a, residual):
        self.steps.append("add_rms_norm")
        return a, residual

    def self_attention(self, x):
        return decoder.attention(NumpyViews(), self, x)

    def mlp(self, x):
        return decoder.mlp(self, x, self.mlp_variant)


class NumpyViews:
    """The backend's views over numpy arrays (the core's reshapes are all it asks of one here)."""

    def shape(self, t):
        return t.shape

    def reshape(self, t, shape):
        return t.reshape(shape)


@pytest.mark.parametrize("attention_variant", sorted(ATTENTION_VARIANTS))
@pytest.mark.parametrize("mlp_variant", sorted(MLP_VARIANTS))
def test_core_decoder_runs_the_named_steps(attention_variant, mlp_variant):
    """The step lists are the steps core.decoder executes, for every variant of each sub-layer."""
    parts = RecordingParts(attention_variant, mlp_variant)
    decoder.decoder_layer(parts, np.zeros((2, 5, parts.hidden), np.float32))
    assert tuple(parts.steps) == decoder_layer_steps(attention_variant, mlp_variant)


def test_core_decoder_names_unknown_variants():
    with pytest.raises(ValueError, match="variant must be"):
        decoder.mlp(RecordingParts("fused", "fused"), np.zeros((1, 1, 12)), "gated")
    with pytest.raises(ValueError, match="variant must be"):
        decoder.attention(NumpyViews(), RecordingParts("grouped", "fused"), np.zeros((1, 1, 12)))


KERNEL_STEPS = {"fastffn_rms_norm_fwd": "rms_norm", "fastffn_rotary": "rotary", "fastffn_swiglu_fwd": "swiglu"}
# (step, sub-layer path in a decoder layer) of the projections a forward hook records
FUSED_PROJECTIONS = (("qkv_proj", "self_attn.qkv_proj"), ("o_proj", "self_attn.o_proj"),
                     ("gate_up_proj", "mlp.gate_up_fused_proj"))
UNFUSED_PROJECTIONS = tuple((step, f"{owner}.{step}") for owner, names in (
    ("self_attn", ("q_proj", "k_proj", "v_proj", "o_proj")), ("mlp", ("gate_proj", "up_proj", "down_proj")))
    for step in names)
LORA_RANK, LORA_ALPHA = 8, 16  # the full-depth benchmark's adapters (benchmarks/gpu/bench_full_depth.py)


def sublayer(layer, path):
    for name in path.split("."):
        layer = getattr(layer, name)
    return layer


def decoder_layers(model):
    return getattr(model, "model", model).llama.layers  # a LoRAModel wraps the LlamaForCausalLM


def traced_forward(model, ids, monkeypatch, wrapped=(), projections=FUSED_PROJECTIONS):
    """The composition steps a forward runs, in order. wrapped: (step, owner, attribute) of further
    callables that record their step; projections: the sub-layers whose forward records its step."""
    from paddlenlp.transformers.llama import modeling

    steps = []

    def on_kernel(name, args):
        if steps and steps[-1] == "swiglu_down_proj" and name == "fastffn_swiglu_fwd":
            return  # swiglu_down_proj's own SwiGLU kernel
        if name == "fastffn_rms_norm_fwd":
            steps.append("add_rms_norm" if args[1] is not None else "rms_norm")
        elif name in KERNEL_STEPS:
            steps.append(KERNEL_STEPS[name])
        else:
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
    for step, owner, attribute in wrapped:
        monkeypatch.setattr(owner, attribute, record(step, getattr(owner, attribute)))
    monkeypatch.setattr(modeling, "scaled_dot_product_attention",
                        record("attention", modeling.scaled_dot_product_attention))
    monkeypatch.setattr(ops, "swiglu_down_proj", record("swiglu_down_proj", ops.swiglu_down_proj))
    for layer in decoder_layers(model):
        for step, path in projections:
            sublayer(layer, path).register_forward_post_hook(
                lambda _layer, _inputs, _out, step=step: steps.append(step))
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


def test_patched_fp8_layers_follow_the_fp8_composition_the_benchmark_runs(monkeypatch):
    """fast_ffn_precision=fp8 (emulated here): qkv_proj and o_proj through Fp8Linear, the MLP as one
    FP8 FFN (gate_up_fused_proj is not called as a layer)."""
    paddle_fastffn.apply_fast_ffn_to_llama(precision="fp8", fp8_emulate=True)
    model = tiny_model(intermediate_size=176)  # FP8 needs every width a multiple of 16
    ids, _, _ = batch()
    steps = traced_forward(model, ids, monkeypatch, wrapped=[("fp8_ffn", Fp8FFN, "__call__")])
    per_layer = [step for step in LLAMA_DECODER_LAYER_FP8 if step != "residual_add"]
    assert steps == per_layer * len(model.llama.layers) + ["rms_norm"], steps


def lora_model(model):
    """LoRAModel as PaddleNLP's llm script builds it on a fast-path model (fused target names, which
    unfuse_for_lora aims at the stock sub-layers), with the full-depth benchmark's rank and alpha."""
    from paddlenlp.peft import LoRAConfig, LoRAModel

    targets = [".*qkv_proj.*", ".*o_proj.*", ".*gate_up_fused_proj.*", ".*down_proj.*"]
    config = LoRAConfig(target_modules=targets, r=LORA_RANK, lora_alpha=LORA_ALPHA, merge_weights=False)
    model = LoRAModel(model, config)
    model.mark_only_lora_as_trainable()
    return model


def assert_lora_projections(model):
    """Every projection the unfused list names is a LoRALinear computing base + (x @ A @ B) * alpha / r
    over a frozen weight, with no dropout: the linear FastDecoderLayer(lora=) runs."""
    from paddlenlp.peft.lora.lora_layers import LoRALinear

    for layer in decoder_layers(model):
        for step, path in UNFUSED_PROJECTIONS:
            linear = sublayer(layer, path)
            assert type(linear) is LoRALinear, (path, type(linear))
            assert linear.weight.stop_gradient and not linear.lora_A.stop_gradient and not linear.merged
            assert linear.scaling == LORA_ALPHA / LORA_RANK and not isinstance(linear.lora_dropout, paddle.nn.Dropout)
            assert not linear.use_quick_lora


def test_lora_layers_follow_the_unfused_composition_the_benchmark_runs(monkeypatch):
    """LoRA on the fast path: the fused projections are split back (unfuse_for_lora), so the layer is
    LLAMA_DECODER_LAYER_UNFUSED: q/k/v_proj, rotary, attention, o_proj, the fused add + norm,
    gate_proj/up_proj, the two-input SwiGLU kernel and down_proj (no swiglu_down_proj: down_proj is
    a LoRALinear)."""
    paddle_fastffn.apply_fast_ffn_to_llama()
    model = lora_model(tiny_model())
    assert_lora_projections(model)
    ids, _, _ = batch()
    steps = traced_forward(model, ids, monkeypatch, projections=UNFUSED_PROJECTIONS)
    per_layer = [step for step in LLAMA_DECODER_LAYER_UNFUSED if step != "residual_add"]
    assert LLAMA_DECODER_LAYER_UNFUSED[-1] == "residual_add"
    assert steps == per_layer * len(decoder_layers(model)) + ["rms_norm"], steps


def test_fp8_lora_layers_follow_the_unfused_composition_with_fp8_base_gemms(monkeypatch):
    """fast_ffn_precision=fp8 with LoRA (emulated here): the same unfused steps, every projection a
    LoRALinear with an Fp8Linear attached (its frozen base GEMM in FP8, the adapters in the
    activation dtype); no MLP runs the FP8 FFN. What FastDecoderLayer(lora=, fp8_recipe=) runs."""
    from paddle_fastffn.fp8 import Fp8Linear

    paddle_fastffn.apply_fast_ffn_to_llama(precision="fp8", fp8_emulate=True)
    model = lora_model(tiny_model(intermediate_size=176))
    assert_lora_projections(model)
    ids, _, _ = batch()
    steps = traced_forward(model, ids, monkeypatch, wrapped=[("fp8_ffn", Fp8FFN, "__call__")],
                           projections=UNFUSED_PROJECTIONS)
    per_layer = [step for step in LLAMA_DECODER_LAYER_UNFUSED if step != "residual_add"]
    assert steps == per_layer * len(decoder_layers(model)) + ["rms_norm"], steps
    attached = fp8_layers(model)
    expected = {f"{prefix}.{path}" for prefix in (name for name, layer in model.named_sublayers()
                                                  if layer in list(decoder_layers(model)))
                for _, path in UNFUSED_PROJECTIONS}
    assert len(expected) == len(UNFUSED_PROJECTIONS) * len(decoder_layers(model))
    assert set(attached) == expected, sorted(set(attached) ^ expected)
    assert all(type(fp8) is Fp8Linear for fp8 in attached.values())


# --- the FP8 FFN's C entry-point calls ------------------------------------------------------------

class CudaCallTracer:
    """Stands in for fp8/cuda.py's _run on a machine without a GPU: records each C entry point the
    Paddle CUDA backend calls, named as composition.FP8_FFN_CALLS names them, and returns
    placeholders of the right shapes and dtypes (zeros: this traces the call order and the
    operands, it computes nothing). Tensors are named by the scaling state whose scale or amax a
    call receives (each role has its own) and FP8 copies by the call that wrote them."""

    def __init__(self, states):
        self.calls = []
        self.role_of = {}
        for role in states.roles():
            state = getattr(states, role)
            self.role_of[id(state.scale)] = self.role_of[id(state.amax_history)] = role
        self.copy_of = {}  # id(FP8 output) -> (tensor, copy)

    def _out(self, shape, dtype, name=None):
        t = paddle.zeros(shape, paddle.float32).astype(dtype)
        if name is not None:
            self.copy_of[id(t)] = name
        return t

    def _written(self, role, rowwise, transposed, shape, cols, dtype, padded):
        """The row-wise [R, C] and transposed [C, padded] copies of `role` (weights: [in, out] as
        Paddle stores them, and [out, in]); empty where not asked for."""
        width = padded or shape[0]  # the transposed copy's row length: a K of the weight gradients
        assert not transposed or (width % 16 == 0 and width >= shape[0]), f"{role}^T: {width} columns"
        weight = role.startswith("w_")
        row_name, col_name = (IN_OUT, OUT_IN) if weight else (ROWWISE, TRANSPOSED)
        data = self._out(shape if rowwise else [0], dtype, (role, row_name) if rowwise else None)
        data_t = self._out([cols, width] if transposed else [0], dtype,
                           (role, col_name) if transposed else None)
        writes = ((role, row_name),) * rowwise + ((role, col_name),) * transposed
        return data, data_t, writes

    def __call__(self, name, *args):
        kernel = name.removeprefix("fastffn_")
        if name == "fastffn_fp8_quantize":
            x, scale, _, fmt, rowwise, transpose, cols = args
            role = self.role_of[id(scale)]
            data, data_t, writes = self._written(role, rowwise, transpose, list(x.shape), x.shape[1],
                                                 FP8_DTYPES[fmt], cols)
            self.calls.append((kernel, role, writes))
            return data, data_t, self._out([1], paddle.float32)
        if name == "fastffn_swiglu_fwd_fp8":
            gate_up, scale, _, gu_scale, gu_amax, fmt, rowwise, _, _, gu_rowwise = args
            shape = [gate_up.shape[0], gate_up.shape[1] // 2]
            data, data_t, writes = self._written(self.role_of[id(scale)], rowwise, False, shape, 0,
                                                 FP8_DTYPES[fmt], 0)
            assert (gu_scale is None) == (gu_amax is None), "gate_up's copy: its scale and amax together"
            assert gu_scale is None or self.role_of[id(gu_scale)] == self.role_of[id(gu_amax)] == "gate_up"
            assert not gu_rowwise or rowwise, "the copy is written by the quantising pass"
            gu, _, gu_writes = self._written("gate_up", gu_rowwise, False, list(gate_up.shape), 0,
                                             FP8_DTYPES[fmt], 0)
            self.calls.append((kernel, "h", writes + gu_writes))
            return data, data_t, self._out([1], paddle.float32), gu, self._out([1], paddle.float32)
        if name == "fastffn_swiglu_bwd_fp8":
            (gate_up, d_h, scale, _, h_scale, gu_scale_inv, fmt, rowwise, transpose, h_fmt, h_rowwise,
             h_transpose, cols) = args
            assert list(d_h.shape) == [gate_up.shape[0], gate_up.shape[1] // 2]
            # gate_up is the forward's FP8 copy (with its scale_inv) or the 16-bit one
            assert (self.copy_of.get(id(gate_up)) == ("gate_up", ROWWISE)) == (gu_scale_inv is not None)
            role = self.role_of[id(scale)]
            rows, width = gate_up.shape
            d, d_t, writes = self._written(role, rowwise, transpose, [rows, width], width, FP8_DTYPES[fmt], cols)
            h_fp8 = FP8_DTYPES.get(h_fmt, paddle.float8_e4m3fn)
            h, h_t, h_writes = self._written("h", h_rowwise, h_transpose, [rows, width // 2], width // 2, h_fp8,
                                             cols)
            assert not h_writes or h_scale is not None, "q(h) needs the forward's scale"
            self.calls.append((kernel, role, writes + h_writes))
            return d, d_t, self._out([1], paddle.float32), h, h_t, self._out([1], paddle.float32)
        if name == "fastffn_gemm":
            a, b, _, _, out_dtype = args[:5]
            assert a.shape[1] == b.shape[1], f"GEMM K mismatch: {a.shape} vs {b.shape}"
            self.calls.append((kernel, (self.copy_of[id(a)], self.copy_of[id(b)])))
            return [self._out([a.shape[0], b.shape[0]], getattr(paddle, out_dtype))]
        assert name in ("fastffn_fp8_compute_scale", "fastffn_fp8_update_amax_history"), name
        self.calls.append((kernel, self.role_of[id(args[0])], ()))
        return []


@pytest.mark.parametrize("scaling, warm_start, saved_gate_up", [
    ("current", True, "fp8"), ("delayed", True, "fp8"), ("delayed", False, "fp8"),
    ("current", True, "activation"), ("delayed", True, "activation")])
@pytest.mark.parametrize("weight_copies", ["per_use", "cached"])
def test_paddle_cuda_fp8_ffn_issues_the_harness_call_sequence(monkeypatch, scaling, warm_start, saved_gate_up,
                                                             weight_copies):
    """The Paddle CUDA FP8 FFN (fp8/ffn.py, traced on CPU with placeholder results) calls the C
    entry points in the order, on the tensors and with the stored copies of
    composition.fp8_ffn_calls, which the harness's Fp8FFN follows too (tests/gpu: the same
    comparison on the H200). Two steps: the first (warm start) and one after an optimizer step.
    37 tokens: the transposed copies are padded to 48 columns."""
    recipe = Fp8Recipe(scaling=scaling, amax_history_len=4, delayed_warm_start=warm_start,
                       saved_gate_up=saved_gate_up)
    states, cache = recipe.ffn_states(), WeightCache() if weight_copies == "cached" else None
    tracer = CudaCallTracer(states)
    monkeypatch.setattr(fp8_cuda, "_run", tracer)
    monkeypatch.setattr(fp8_cuda, "_state_on", lambda state, place: None)
    tokens, hidden, inter = 37, 32, 80
    for step in range(2):
        x = paddle.randn([tokens, hidden]).astype(paddle.bfloat16)
        w_gate_up = paddle.randn([hidden, 2 * inter]).astype(paddle.bfloat16)
        w_down = paddle.randn([inter, hidden]).astype(paddle.bfloat16)
        for t in (x, w_gate_up, w_down):
            t.stop_gradient = False
        tracer.calls.clear()
        y = fp8_ffn_cuda(x, w_gate_up, w_down, states=states, weight_cache=cache)
        y.backward(paddle.ones_like(y))
        assert y.shape == x.shape and y.dtype == x.dtype
        assert (x.grad.shape, w_gate_up.grad.shape, w_down.grad.shape) == (x.shape, w_gate_up.shape, w_down.shape)
        expected = fp8_ffn_calls(scaling, first_step=step == 0, delayed_warm_start=warm_start,
                                 saved_gate_up=saved_gate_up, weight_copies=weight_copies)
        assert comparable(tracer.calls) == comparable(expected), f"step {step}:\n{tracer.calls}"
        assert all(state.seeded for state in map(lambda r: getattr(states, r), states.roles()))
