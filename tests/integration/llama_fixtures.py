"""A tiny LLaMA-2-architecture model and batch for the integration tests."""

import numpy as np
import paddle
from paddlenlp.transformers import LlamaConfig, LlamaForCausalLM

from paddle_fastffn.fp8 import track_optimizer


def tiny_config(**overrides):
    # Grouped-query attention (4 q heads, 2 kv heads), an intermediate width that is not a
    # multiple of 8, and two layers: small enough for CPU, every fused path exercised.
    values = dict(vocab_size=128, hidden_size=64, intermediate_size=172, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                  rms_norm_eps=1e-6, tie_word_embeddings=False)
    values.update(overrides)
    return LlamaConfig(**values)


def tiny_model(seed=0, **overrides):
    paddle.seed(seed)
    return LlamaForCausalLM(tiny_config(**overrides))


def batch(seed=0, batch_size=3, seq=13, vocab=128, pad_first=2):
    rng = np.random.default_rng(seed)
    ids = paddle.to_tensor(rng.integers(3, vocab, size=(batch_size, seq)), dtype="int64")
    labels = paddle.to_tensor(rng.integers(3, vocab, size=(batch_size, seq)), dtype="int64")
    mask = np.ones((batch_size, seq), dtype="int64")
    mask[-1, :pad_first] = 0  # left padding on the last row
    return ids, labels, paddle.to_tensor(mask)


def logits_of(model, ids, mask=None):
    out = model(ids, attention_mask=mask)
    return out[0] if isinstance(out, tuple) else out.logits


def loss_and_grads(model, ids, labels, mask=None):
    for p in model.parameters():
        p.clear_gradient()
    out = model(ids, labels=labels, attention_mask=mask)
    loss = out[0] if isinstance(out, tuple) else out.loss
    loss.backward()
    return float(loss), {n: p.grad.numpy().copy() for n, p in model.named_parameters() if p.grad is not None}


def train_steps(model, steps, parameters=None, batches=2):
    """AdamW (lr 3e-3, weight decay 0.01) for `steps` steps over `batches` fixed batches in turn
    (few enough to memorise, so losses fall); returns the per-step losses."""
    # Tracked: its updates re-quantise FP8 weights (a hand-written loop says so; the Trainer does it)
    optimizer = track_optimizer(paddle.optimizer.AdamW(learning_rate=3e-3,
                                                       parameters=parameters or model.parameters(),
                                                       weight_decay=0.01))
    losses = []
    for step in range(steps):
        ids, labels, mask = batch(seed=step % batches)
        out = model(ids, labels=labels, attention_mask=mask)
        loss = out[0] if isinstance(out, tuple) else out.loss
        loss.backward()
        optimizer.step()
        optimizer.clear_grad()
        losses.append(float(loss))
    return np.array(losses)
