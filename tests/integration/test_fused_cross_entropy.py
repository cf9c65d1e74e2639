"""The fused LM head + cross-entropy in the LLaMA patch: a training forward with labels computes
PaddleNLP's loss through ops.linear_cross_entropy (same losses and gradients as stock, no
[tokens, vocab] tensor); eval, generation, unsupported heads and the switch keep the stock head."""

import importlib
import math

import numpy as np
import paddle
import pytest

import paddle_fastffn
from llama_fixtures import batch, loss_and_grads, tiny_model
from tolerances import assert_close

core_lce = importlib.import_module("paddle_fastffn.core.linear_cross_entropy")
VOCAB = 128  # llama_fixtures.tiny_config


@pytest.fixture
def matmul_shapes(monkeypatch):
    """Output shapes of every paddle.matmul call (the LM head's and the fused op's GEMMs)."""
    shapes = []
    matmul = paddle.matmul

    def recording(x, y, *args, **kwargs):
        out = matmul(x, y, *args, **kwargs)
        shapes.append(list(out.shape))
        return out

    monkeypatch.setattr(paddle, "matmul", recording)
    return shapes


def _train(model, steps, seed=0):
    """AdamW steps on two alternating batches; per-step losses and the first step's gradients."""
    optimizer = paddle.optimizer.AdamW(learning_rate=3e-3, parameters=model.parameters(), weight_decay=0.01)
    losses, first_grads = [], None
    for step in range(steps):
        ids, labels, mask = batch(seed=seed + step % 2)
        labels_np = labels.numpy()
        labels_np[0, :4] = -100  # a masked prompt, as the fine-tune data has
        out = model(ids, labels=paddle.to_tensor(labels_np), attention_mask=mask)
        loss = out[0] if isinstance(out, tuple) else out.loss
        loss.backward()
        if first_grads is None:
            first_grads = {n: p.grad.numpy().copy() for n, p in model.named_parameters() if p.grad is not None}
        optimizer.step()
        optimizer.clear_grad()
        losses.append(float(loss))
    return np.array(losses), first_grads


def test_training_steps_match_stock_and_the_unfused_fast_path(kernel_calls):
    steps = 8
    stock_losses, stock_grads = _train(tiny_model(seed=3), steps)
    paddle_fastffn.apply_fast_ffn_to_llama(fused_cross_entropy=False)
    plain_losses, plain_grads = _train(tiny_model(seed=3), steps)
    assert kernel_calls()["fastffn_cross_entropy"] == 0
    paddle_fastffn.revert_fast_ffn()
    paddle_fastffn.apply_fast_ffn_to_llama()  # fused_cross_entropy is on by default
    fused_losses, fused_grads = _train(tiny_model(seed=3), steps)
    assert kernel_calls()["fastffn_cross_entropy"] == steps
    # fp32 throughout. The first step's loss and gradients differ from the fast path without the
    # fused loss only by reduction order (1e-7 relative); Adam's division by sqrt(v) lets later
    # steps drift slowly, as in the fast-vs-stock convergence test.
    assert abs(fused_losses[0] - plain_losses[0]) <= 1e-6 * plain_losses[0]
    np.testing.assert_allclose(fused_losses, plain_losses, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(fused_losses, stock_losses, rtol=1e-4, atol=1e-5)
    assert fused_grads.keys() == plain_grads.keys()
    for name in plain_grads:
        np.testing.assert_allclose(fused_grads[name], plain_grads[name], rtol=1e-4, atol=1e-7, err_msg=name)
    shared = fused_grads.keys() & stock_grads.keys()  # stock has q/k/v and gate/up unfused
    assert {"lm_head.weight", "llama.embed_tokens.weight", "llama.norm.weight"} <= shared
    for name in shared:
        np.testing.assert_allclose(fused_grads[name], stock_grads[name], rtol=2e-4, atol=2e-6, err_msg=name)


def test_the_fused_path_never_builds_a_tokens_by_vocab_tensor(monkeypatch, matmul_shapes, kernel_calls):
    chunk = 8
    monkeypatch.setattr(core_lce, "CPU_CHUNK_BYTES", chunk * VOCAB * 4)  # 8 tokens per chunk
    ids, labels, mask = batch()  # 3 x 13 = 39 tokens
    model = tiny_model()
    loss_and_grads(model, ids, labels, mask)  # stock: the head's [3, 13, 128] logits
    assert [3, 13, VOCAB] in matmul_shapes
    matmul_shapes.clear()
    paddle_fastffn.apply_fast_ffn_to_llama(model)
    loss_and_grads(model, ids, labels, mask)
    vocab_wide = [s for s in matmul_shapes if s[-1] == VOCAB]
    # Logits chunks of at most `chunk` tokens, and once the [H, V] weight gradient: the first
    # chunk's product starts d_weight (H = 64 is not the token count, 39); later chunks add into it
    # in place, by addmm_.
    hidden = model.config.hidden_size
    assert [chunk, VOCAB] in vocab_wide and [39 - 4 * chunk, VOCAB] in vocab_wide
    assert vocab_wide.count([hidden, VOCAB]) == 1, vocab_wide
    assert all(len(s) == 2 and s[0] <= chunk for s in vocab_wide if s != [hidden, VOCAB]), vocab_wide
    assert kernel_calls()["fastffn_cross_entropy"] == math.ceil(39 / chunk)


@pytest.mark.parametrize("return_dict", [False, True], ids=["tuple", "model_output"])
def test_training_returns_the_stock_structure_without_logits(return_dict):
    model = tiny_model(return_dict=return_dict)
    ids, labels, mask = batch()
    ref = model(ids, labels=labels, attention_mask=mask)
    paddle_fastffn.apply_fast_ffn_to_llama(model)
    out = model(ids, labels=labels, attention_mask=mask)
    if return_dict:
        assert out.logits is None and out.loss.shape == [] and type(out) is type(ref)
        assert_close(out.loss, ref.loss, paddle.float32, "loss")
        assert out[0] is out.loss  # what the Trainer's compute_loss reads
    else:
        assert isinstance(out, tuple) and len(out) == len(ref) and out[1] is None
        assert_close(out[0], ref[0], paddle.float32, "loss")


def test_eval_and_forwards_without_labels_take_the_stock_head(kernel_calls):
    model = tiny_model()
    ids, labels, mask = batch()
    model.eval()
    with paddle.no_grad():
        ref_loss, ref_logits = model(ids, labels=labels, attention_mask=mask)[:2]
    paddle_fastffn.apply_fast_ffn_to_llama(model)
    with paddle.no_grad():
        loss, logits = model(ids, labels=labels, attention_mask=mask)[:2]  # what prediction_step gets
        only_logits = model(ids, attention_mask=mask)
    assert kernel_calls()["fastffn_cross_entropy"] == 0
    assert_close(loss, ref_loss, paddle.float32, "eval loss")
    assert_close(logits.numpy()[:-1], ref_logits.numpy()[:-1], paddle.float32, "eval logits")
    logits_only = only_logits[0] if isinstance(only_logits, tuple) else only_logits
    assert list(logits_only.shape) == [3, 13, VOCAB]


def test_trainer_trains_on_the_fused_loss_and_evaluates_on_stock_logits(tmp_path, kernel_calls):
    from paddlenlp.trainer import PdArgumentParser, Trainer

    rng = np.random.default_rng(0)
    rows = [{"input_ids": ids, "labels": ids[1:] + [-100]} for ids in rng.integers(3, 128, size=(8, 12)).tolist()]
    metrics_seen = []

    def compute_metrics(prediction):
        metrics_seen.append(np.asarray(prediction.predictions).shape)
        return {"seen": 1.0}

    def run(use_fast_ffn):
        paddle_fastffn.revert_fast_ffn()
        parser = PdArgumentParser((paddle_fastffn.FastFFNTrainingArguments,))
        args = parser.parse_dict(dict(output_dir=str(tmp_path / str(use_fast_ffn)), use_fast_ffn=use_fast_ffn,
                                      max_steps=3, per_device_train_batch_size=4, per_device_eval_batch_size=4,
                                      learning_rate=1e-2, logging_steps=1, report_to="none", device="cpu",
                                      disable_tqdm=True, save_strategy="no", seed=7))[0]
        model = tiny_model(seed=4)
        trainer = Trainer(model=model, args=args, train_dataset=rows, eval_dataset=rows,
                          compute_metrics=compute_metrics)
        result = trainer.train()
        return result.training_loss, trainer.evaluate()

    stock_train, stock_eval = run(False)
    fast_train, fast_eval = run(True)
    assert kernel_calls()["fastffn_cross_entropy"] == 3  # the three training steps, not evaluate()
    assert abs(fast_train - stock_train) <= 1e-4 * stock_train
    assert abs(fast_eval["eval_loss"] - stock_eval["eval_loss"]) <= 1e-4 * stock_eval["eval_loss"]
    assert fast_eval["eval_seen"] == 1.0
    assert metrics_seen[0] == metrics_seen[1] == (8, 12, VOCAB)  # eval still hands logits to metrics


def _tie(model):
    """PaddleNLP 2.8.1's tie_weights(): the head's weight becomes the [V, H] input embedding."""
    model.config.tie_word_embeddings = True
    model.tie_weights()
    assert model.lm_head.weight is model.llama.embed_tokens.weight


def test_tied_embeddings_use_the_embedding_transposed(kernel_calls):
    ids, labels, mask = batch()
    # The stock model with an untied head holding E^T: the same function of the same numbers.
    untied = tiny_model(seed=5)
    embedding = untied.llama.embed_tokens.weight.numpy()
    untied.lm_head.weight.set_value(embedding.T.copy())
    ref_loss, ref_grads = loss_and_grads(untied, ids, labels, mask)

    tied = tiny_model(seed=5)
    _tie(tied)
    paddle_fastffn.apply_fast_ffn_to_llama(tied)
    loss, grads = loss_and_grads(tied, ids, labels, mask)
    assert kernel_calls()["fastffn_cross_entropy"] == 1
    assert abs(loss - ref_loss) <= 1e-5 * ref_loss
    # The tied weight's gradient is the embedding's plus the head's (transposed back).
    expected = ref_grads["llama.embed_tokens.weight"] + ref_grads["lm_head.weight"].T
    np.testing.assert_allclose(grads["llama.embed_tokens.weight"], expected, rtol=2e-4, atol=2e-6)
    assert "lm_head.weight" not in grads or grads["lm_head.weight"] is grads["llama.embed_tokens.weight"]


def test_the_switch_turns_it_off(kernel_calls):
    model = tiny_model()
    ids, labels, mask = batch()
    paddle_fastffn.apply_fast_ffn_to_llama(model, fused_cross_entropy=False)
    out = model(ids, labels=labels, attention_mask=mask)
    assert list(out[1].shape) == [3, 13, VOCAB]
    assert kernel_calls()["fastffn_cross_entropy"] == 0


def test_a_head_it_cannot_read_keeps_stock_with_one_info_line(info_lines, kernel_calls):
    from paddlenlp.transformers.llama.modeling import LlamaLMHead

    class ScaledHead(LlamaLMHead):  # some other head: its forward is not a plain matmul
        def forward(self, hidden_states, tensor_parallel_output=None):
            return 0.5 * super().forward(hidden_states, tensor_parallel_output)

    model = tiny_model()
    head = ScaledHead(model.config)
    head.weight.set_value(model.lm_head.weight)
    model.lm_head = head
    ids, labels, mask = batch()
    ref_loss, _ = loss_and_grads(model, ids, labels, mask)
    paddle_fastffn.apply_fast_ffn_to_llama(model)
    for _ in range(2):
        loss, _ = loss_and_grads(model, ids, labels, mask)
    assert abs(loss - ref_loss) <= 1e-5 * ref_loss
    assert kernel_calls()["fastffn_cross_entropy"] == 0
    fused_lines = [line for line in info_lines if "fused_cross_entropy" in line]
    assert len(fused_lines) == 1 and "the LM head is ScaledHead" in fused_lines[0]


def test_tensor_parallel_config_keeps_the_stock_head(info_lines):
    model = tiny_model()
    paddle_fastffn.apply_fast_ffn_to_llama(model)
    model.config.tensor_parallel_degree = 2  # what a sharded head's config says (not run: no TP on CPU)
    from paddle_fastffn.integration import llama as llama_patch

    weight, _, reason = llama_patch.fused_head_weight(model)
    assert weight is None and "tensor_parallel_degree=2" in reason
