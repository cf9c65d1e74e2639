import numpy as np
import paddle
from paddlenlp.transformers import LlamaForCausalLM

import paddle_fastffn
from llama_fixtures import batch, logits_of, tiny_model, train_steps
from hub_checkpoints import save_hub_checkpoint
from paddle_fastffn.finetune.checkpoint import is_hf_checkpoint
from tolerances import assert_close


def test_hf_format_checkpoint_loads_into_the_fast_path(tmp_path):
    source = tiny_model()
    save_hub_checkpoint(source, tmp_path / "hf", "safetensors", dtype="float32")
    assert is_hf_checkpoint(tmp_path / "hf")
    ids, _, mask = batch()
    ref = logits_of(source, ids, mask).numpy()
    paddle_fastffn.apply_fast_ffn_to_llama()
    fast = LlamaForCausalLM.from_pretrained(str(tmp_path / "hf"), convert_from_torch=True)
    got = logits_of(fast, ids, mask).numpy()
    assert_close(got[:-1], ref[:-1], paddle.float32, "HF checkpoint on the fast path")
    assert_close(got[-1, 2:], ref[-1, 2:], paddle.float32, "HF checkpoint on the fast path (padded row)")


def test_training_losses_match_stock_step_by_step_and_checkpoint_loads_in_stock(tmp_path):
    steps = 24
    stock_losses = train_steps(tiny_model(seed=3), steps)
    paddle_fastffn.apply_fast_ffn_to_llama()
    fast = tiny_model(seed=3)
    fast_losses = train_steps(fast, steps)
    # fp32 on both sides; the fused kernels reorder reductions (1e-7 relative per op) and Adam
    # divides by sqrt(v), so per-step differences grow slowly: 24 steps stay within 1e-4.
    np.testing.assert_allclose(fast_losses, stock_losses, rtol=1e-4, atol=1e-5)
    assert fast_losses[-1] < 0.8 * fast_losses[0]  # it learned something
    fast.save_pretrained(str(tmp_path / "fast"))
    ids, _, mask = batch(seed=99)
    fast_logits = logits_of(fast, ids, mask).numpy()
    paddle_fastffn.revert_fast_ffn()
    stock = LlamaForCausalLM.from_pretrained(str(tmp_path / "fast"), use_flash_attention=False)
    stock_logits = logits_of(stock, ids, mask).numpy()
    assert_close(stock_logits[:-1], fast_logits[:-1], paddle.float32, "fast checkpoint in stock PaddleNLP")
