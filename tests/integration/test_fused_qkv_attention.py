"""The fast path's fused-QKV attention (integration/llama.py fast_attention_forward, core.decoder.attention):
q, k and v come out of PaddleNLP's interleaved qkv_proj output through ops.qkv_rotary, so a layer's
forward and backward run no paddle.split (three copies per layer and step) and no concat (split's
backward), and the gradients are stock PaddleNLP's. Paddle's operators are recorded with
paddle.profiler (every kernel launched, forward and backward, its grad nodes included); the stock
layer's run shows the split and concat the recorder must see."""

import numpy as np
import paddle
import paddle.profiler as profiler
import pytest

import paddle_fastffn
from llama_fixtures import batch, tiny_model
from tolerances import assert_close

COPYING_OPS = {"split", "split_with_num", "concat"}


def launched_kernels(run) -> list:
    """The Paddle kernels `run()` launches, in order (host-side events of the CPU profiler)."""
    prof = profiler.Profiler(targets=[profiler.ProfilerTarget.CPU], on_trace_ready=lambda _prof: None)
    prof.start()
    run()
    prof.stop()
    names = []

    def walk(node):
        if node.type == profiler.TracerEventType.DygraphKernelLaunch:
            names.append(node.name.removesuffix(" kernel launch"))
        for child in node.children_node:
            walk(child)
    for root in prof.profiler_result.get_data().values():
        walk(root)
    return names


def layer_forward_backward(layer, hidden, position_ids=None):
    """Gradients of one decoder layer's forward + backward: {name: array} of the input and every
    parameter, and the kernels the call launched."""
    x = paddle.to_tensor(hidden, stop_gradient=False)
    dy = paddle.to_tensor(np.random.default_rng(1).standard_normal(hidden.shape).astype("float32"))
    for p in layer.parameters():
        p.clear_gradient()

    def run():
        out = layer(x, position_ids=position_ids)
        out = out[0] if isinstance(out, tuple) else out
        out.backward(dy)
    kernels = launched_kernels(run)
    grads = {name: p.grad.numpy() for name, p in layer.named_parameters() if p.grad is not None}
    grads["hidden_states"] = x.grad.numpy()
    return grads, kernels


@pytest.mark.parametrize("packed_positions", [False, True], ids=["positions_none", "position_ids"])
@pytest.mark.parametrize("flash", [True, False], ids=["flash_attention", "eager_attention"])
def test_fused_qkv_layer_runs_no_split_or_concat_and_matches_stock_gradients(packed_positions, flash):
    """flash: PaddleNLP's use_flash_attention path (fast_ffn_attention, the default), or its eager
    attention, which wants k and v repeated per query head."""
    paddle_fastffn.apply_fast_ffn_to_llama(attention=flash)
    fast = tiny_model(seed=3)  # fused qkv_proj (GQA: 4 query heads, 2 KV heads)
    assert fast.config.fuse_attention_qkv and fast.config.use_flash_attention == flash
    weights = {name: value.numpy() for name, value in fast.state_dict().items()}
    hidden = np.random.default_rng(0).standard_normal([2, 9, fast.config.hidden_size]).astype("float32")
    # positions restarting mid-row, as a packed batch's (the rotary op reads them per token)
    position_ids = paddle.to_tensor([list(range(4)) + list(range(5))] * 2, dtype="int64") if packed_positions else None
    fast_grads, fast_kernels = layer_forward_backward(fast.llama.layers[0], hidden, position_ids)

    paddle_fastffn.revert_fast_ffn()
    stock = tiny_model(seed=0, fuse_attention_qkv=True, fuse_attention_ffn=True, use_flash_attention=flash)
    stock.set_state_dict(weights)
    stock_grads, stock_kernels = layer_forward_backward(stock.llama.layers[0], hidden, position_ids)

    assert {"split", "concat"} <= set(stock_kernels) or {"split_with_num", "concat"} <= set(stock_kernels), (
        f"the recorder must see stock's split and its backward's concat: {stock_kernels}")
    assert not COPYING_OPS & set(fast_kernels), [k for k in fast_kernels if k in COPYING_OPS]
    assert fast_grads.keys() == stock_grads.keys()
    for name in stock_grads:
        assert_close(fast_grads[name], stock_grads[name], paddle.float32, name)


def test_other_attention_paths_keep_stock_forward():
    """A KV cache (generation) is not the plain fused path: PaddleNLP's own forward runs, with its
    split, and returns the cache."""
    paddle_fastffn.apply_fast_ffn_to_llama()
    model = tiny_model(seed=3)
    model.eval()
    hidden = paddle.randn([1, 5, model.config.hidden_size])
    attention = model.llama.layers[0].self_attn
    kernels = launched_kernels(lambda: attention(hidden, use_cache=True))
    assert "split" in kernels or "split_with_num" in kernels
    out, cache = attention(hidden, use_cache=True)
    assert list(cache[0].shape) == [1, 5, model.config.num_key_value_heads, attention.head_dim]


def recomputed_functions(model, ids, labels, monkeypatch) -> list:
    """What PaddleNLP's recompute wraps during one training forward + backward, by role ("fast_"
    dropped: the fast path's SDPA is the module function it replaces)."""
    from paddlenlp.transformers.llama import modeling

    wrapped, recompute = [], modeling.recompute

    def recording(function, *args, **kwargs):
        name = getattr(function, "__name__", type(function).__name__)
        wrapped.append(name.removeprefix("fast_"))
        return recompute(function, *args, **kwargs)
    monkeypatch.setattr(modeling, "recompute", recording)
    model.apply(lambda layer: setattr(layer, "enable_recompute", True) if hasattr(layer, "enable_recompute") else None)
    out = model(ids, labels=labels)
    (out[0] if isinstance(out, tuple) else out.loss).backward()
    monkeypatch.setattr(modeling, "recompute", recompute)
    return wrapped


@pytest.mark.parametrize("granularity", ["full_attn", "core_attn"])
def test_attention_recompute_wraps_what_stock_wraps(granularity, monkeypatch):
    """PaddleNLP's layer-wise recompute: full_attn wraps the attention sub-layer (the decoder
    layer's call of self_attn), core_attn the attention kernel (the fused attention forward's SDPA),
    once per layer each, as stock's forwards do; the gradients stay stock's."""
    ids, labels, _ = batch()
    overrides = dict(recompute_granularity=granularity, recompute_use_reentrant=False)
    paddle_fastffn.apply_fast_ffn_to_llama()
    fast = tiny_model(seed=3, **overrides)
    weights = {name: value.numpy() for name, value in fast.state_dict().items()}
    fast_wrapped = recomputed_functions(fast, ids, labels, monkeypatch)
    fast_grads = {n: p.grad.numpy() for n, p in fast.named_parameters() if p.grad is not None}

    paddle_fastffn.revert_fast_ffn()
    stock = tiny_model(seed=0, fuse_attention_qkv=True, fuse_attention_ffn=True, use_flash_attention=True, **overrides)
    stock.set_state_dict(weights)
    stock_wrapped = recomputed_functions(stock, ids, labels, monkeypatch)
    stock_grads = {n: p.grad.numpy() for n, p in stock.named_parameters() if p.grad is not None}

    expected = "LlamaAttention" if granularity == "full_attn" else "scaled_dot_product_attention"
    assert stock_wrapped == [expected] * stock.config.num_hidden_layers, stock_wrapped
    assert fast_wrapped == stock_wrapped
    assert fast_grads.keys() == stock_grads.keys()
    for name in stock_grads:
        assert_close(fast_grads[name], stock_grads[name], paddle.float32, name,
                     reduced_rows=ids.shape[0] * ids.shape[1])
