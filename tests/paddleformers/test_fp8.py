"""Emulated FP8 on PaddleFormers' LLaMA where its LoRALinear differs from PaddleNLP's: a base weight
held only in FP8 under LoRA's merge()/unmerge() (PaddleFormers merges there, not in eval()) and its
disable_lora switch; and the checkpoint an FP8 run saves is stock."""

import numpy as np
import paddle

from paddle_fastffn.integration import fp8_attach, paddleformers_llama as family, registry
from paddle_fastffn.integration.options import FastFFNOptions
from helpers import fp8_heads_made
from tolerances import FP8_HEAD_VS_FP32_RTOL, FP8_TRAINING_LOSS_RTOL

FP8 = FastFFNOptions(precision="fp8", fp8_emulate=True, fp8_scaling="current")


def _lora_model():
    from paddleformers.peft import LoRAConfig, LoRAModel
    from paddleformers.transformers import LlamaForCausalLM

    paddle.seed(3)
    model = LoRAModel(LlamaForCausalLM(family.example_config()),
                      LoRAConfig(target_modules=[".*q_proj.*", ".*down_proj.*"], r=4, lora_alpha=8))
    model.mark_only_lora_as_trainable()
    for name, param in model.named_parameters():
        if name.endswith("lora_B"):  # non-zero adapters, so that merging changes the base weight
            param.set_value(paddle.normal(0.0, 0.05, param.shape))
    return model


def _q_proj(model):
    return model.model.model.layers[1].self_attn.q_proj


def test_lora_merge_unmerge_and_disable_over_a_base_held_in_fp8():
    registry.enable(FP8)
    model = _lora_model()
    ids = paddle.arange(32, dtype="int64").reshape([2, 16]) % 128
    model.eval()
    before = model(input_ids=ids)[0].numpy()
    q_proj = _q_proj(model)
    fp8 = fp8_attach.fp8_of(q_proj)
    assert fp8.holds_frozen_weight() and fp8.frozen_quantizations == 1
    stock_base = paddle.to_tensor(q_proj.weight.numpy())

    restores, restore = [], fp8.restore_weight
    fp8.restore_weight = lambda: (restores.append(q_proj.merged), restore())[1]
    q_proj.merge()  # stock's set_value of base + adapters, on the 16-bit weight put back first
    assert restores == [False], restores  # put back before stock merged
    delta = (q_proj.lora_A @ q_proj.lora_B * q_proj.scaling).numpy()
    np.testing.assert_allclose(q_proj.weight.numpy(), stock_base.numpy() + delta, rtol=1e-6, atol=1e-7)
    merged = model(input_ids=ids)[0].numpy()
    assert fp8.frozen_quantizations == 2  # the merged weight, quantised again
    # The merged GEMM against base GEMM + adapters in 16 bits: one more e4m3 rounding of the adapters.
    assert np.linalg.norm(merged - before) <= 0.05 * np.linalg.norm(before)

    q_proj.unmerge()
    np.testing.assert_allclose(q_proj.weight.numpy(), stock_base.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(model(input_ids=ids)[0].numpy(), before, rtol=1e-5, atol=1e-6)

    x = paddle.randn([4, q_proj.weight.shape[0]])
    with_adapters = q_proj(x).numpy()
    q_proj.disable_lora = True  # PaddleFormers' switch: the base GEMM alone
    base_only = q_proj(x).numpy()
    np.testing.assert_allclose(with_adapters - base_only,
                               (x @ q_proj.lora_A @ q_proj.lora_B * q_proj.scaling).numpy(), rtol=1e-5, atol=1e-6)


def test_an_fp8_run_saves_a_stock_checkpoint(tmp_path):
    from paddleformers.transformers import LlamaForCausalLM

    registry.enable(FP8)
    paddle.seed(4)
    model = LlamaForCausalLM(family.example_config())
    ids = paddle.arange(32, dtype="int64").reshape([2, 16]) % 128
    model(input_ids=ids, labels=ids)[0].backward()
    assert len(fp8_attach.fp8_layers(model)) == 2 * 7
    model.save_pretrained(str(tmp_path))
    registry.disable()
    stock = LlamaForCausalLM.from_pretrained(str(tmp_path), dtype="float32")
    assert {k: (v.dtype, v.shape) for k, v in stock.state_dict().items()} == {
        k: (v.dtype, v.shape) for k, v in model.state_dict().items()}
    np.testing.assert_array_equal(stock.state_dict()["model.layers.0.self_attn.q_proj.weight"].numpy(),
                                  model.state_dict()["model.layers.0.self_attn.q_proj.weight"].numpy())


def test_fp8_lm_head_runs_the_fused_loss_gemms_in_fp8():
    """fp8_lm_head=fp8 on PaddleFormers' LLaMA: its training loss through the FP8 head (the tied
    [V, H] layout PaddleFormers' LMHead keeps), close to the 16-bit head's with the same FP8 layers."""
    from paddleformers.transformers import LlamaForCausalLM

    ids = paddle.arange(32, dtype="int64").reshape([2, 16]) % 128
    results, made = {}, {}
    for head in ("bf16", "fp8"):
        registry.enable(FastFFNOptions(precision="fp8", fp8_emulate=True, fp8_scaling="current", fp8_lm_head=head))
        paddle.seed(4)
        model = LlamaForCausalLM(family.example_config())
        with fp8_heads_made() as made[head]:
            loss = model(input_ids=ids, labels=ids)[0]
            loss.backward()
        results[head] = (float(loss), model.lm_head.weight.grad.numpy())
        registry.disable()
    assert made == {"bf16": [], "fp8": [(True, True, "out_in")]}  # the FP8 run only, once, the tied layout
    (bf16_loss, bf16_grad), (fp8_loss, fp8_grad) = results["bf16"], results["fp8"]
    assert fp8_loss != bf16_loss and abs(fp8_loss - bf16_loss) <= FP8_TRAINING_LOSS_RTOL * abs(bf16_loss)
    assert np.linalg.norm(fp8_grad - bf16_grad) <= FP8_HEAD_VS_FP32_RTOL * np.linalg.norm(bf16_grad)
