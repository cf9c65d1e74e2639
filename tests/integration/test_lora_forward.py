"""The fused LoRA forward (integration/lora_forward.py) on the LoRALinear layers of a patched
LLaMA: attached at the model's forward, the stock formula's output and gradients (dropout
included), the stock forward where its semantics differ, and gone after revert_fast_ffn()."""

import paddle
from paddlenlp.peft import LoRAConfig, LoRAModel
from paddlenlp.peft.lora.lora_layers import LoRALinear

import paddle_fastffn
from llama_fixtures import batch, tiny_model
from paddle_fastffn.integration import lora_forward
from tolerances import assert_close

TARGETS = [".*q_proj.*", ".*v_proj.*", ".*gate_proj.*", ".*down_proj.*"]


def _lora_model(**config):
    model = LoRAModel(tiny_model(), LoRAConfig(target_modules=TARGETS, r=4, lora_alpha=8, **config))
    model.mark_only_lora_as_trainable()
    paddle.seed(3)
    for name, p in model.named_parameters():  # non-zero B so that the adapters reach the output
        if "lora_B" in name:
            p.set_value(paddle.randn(p.shape) * 0.05)
    return model


def _lora_layers(model):
    return [layer for layer in model.sublayers() if type(layer) is LoRALinear]


def _forward_and_grads(model, seed=0):
    ids, labels, mask = batch()
    paddle.seed(seed)
    loss = model(ids, labels=labels, attention_mask=mask)[0]
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.clear_gradients()
    return loss, grads


def test_each_lora_layer_runs_the_fused_forward_and_revert_restores_stock(monkeypatch):
    paddle_fastffn.apply_fast_ffn_to_llama()
    model = _lora_model(merge_weights=False, lora_dropout=0.1)
    model.train()
    layers = _lora_layers(model)
    assert len(layers) == 8  # q, v, gate, down in both decoder layers
    loss, grads = _forward_and_grads(model)
    assert all(isinstance(layer.__dict__.get("forward"), lora_forward.FusedLoRAForward) for layer in layers)
    # The stock LoRALinear.forward in the same patched model, the same dropout draws.
    with monkeypatch.context() as patch:
        patch.setattr(lora_forward, "stock_forward_needed", lambda layer, x: True)
        stock_loss, stock_grads = _forward_and_grads(model)
    assert float(loss) != float(_forward_and_grads(model, seed=1)[0])  # the dropout draws matter
    assert_close(loss, stock_loss, paddle.float32, "loss")
    assert grads.keys() == stock_grads.keys() and any("lora_A" in n for n in grads)
    for name, grad in grads.items():
        assert_close(grad, stock_grads[name], paddle.float32, name, reduced_rows=39)
    paddle_fastffn.revert_fast_ffn()
    assert all("forward" not in layer.__dict__ for layer in layers)
    _forward_and_grads(model)  # stock LlamaModel.forward attaches nothing
    assert all("forward" not in layer.__dict__ for layer in layers)


def test_the_stock_forward_runs_where_its_semantics_differ():
    paddle_fastffn.apply_fast_ffn_to_llama()
    model = _lora_model(merge_weights=True)
    layer = _lora_layers(model)[0]
    x = paddle.randn([2, layer.weight.shape[0]])
    assert not lora_forward.stock_forward_needed(layer, x)
    assert lora_forward.stock_forward_needed(layer, x.astype(paddle.bfloat16))  # no CPU 16-bit GEMM
    model.eval()  # merge_weights: the adapters go into the weight
    assert layer.merged and lora_forward.stock_forward_needed(layer, x)
    model.train()
    layer.pissa, layer.apply_pissa = True, False  # PiSSA initialises at its first forward
    assert lora_forward.stock_forward_needed(layer, x)
    layer.pissa = False
    layer._use_quick_lora = True  # PaddleNLP's own fused autograd function
    assert lora_forward.stock_forward_needed(layer, x)


def test_models_not_patched_keep_the_stock_forward():
    model = _lora_model(merge_weights=False)
    _forward_and_grads(model)
    assert all("forward" not in layer.__dict__ for layer in _lora_layers(model))
