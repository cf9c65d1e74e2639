import numpy as np
import paddle
import pytest

import paddle_fastffn
from llama_fixtures import batch, logits_of, loss_and_grads, tiny_config, tiny_model
from paddle_fastffn.integration import llama as llama_patch
from tolerances import assert_close


def test_every_decoder_layer_is_patched_and_keys_are_unchanged():
    model = tiny_model(num_hidden_layers=3)
    keys = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert paddle_fastffn.apply_fast_ffn_to_llama(model) == 3
    assert {k: tuple(v.shape) for k, v in model.state_dict().items()} == keys
    assert model.config.use_flash_attention  # SDPA path


def test_layers_built_after_enabling_are_patched_at_construction():
    paddle_fastffn.apply_fast_ffn_to_llama()
    model = tiny_model()
    assert llama_patch.patched_layer_count(model) == 2
    assert model.config.use_flash_attention  # set by the construction hook, before any forward
    assert model.config.fuse_attention_qkv and model.config.fuse_attention_ffn  # fused by default


def test_the_patch_is_applied_once_for_the_same_options():
    """As a run does: the TrainingArguments enable the fast path, the script then applies it to the
    model it built. The class attributes and hooks are set once; later applications change none."""
    from paddlenlp.peft import LoRAModel
    from paddlenlp.transformers.llama import modeling

    from paddle_fastffn.integration import registry
    from paddle_fastffn.integration.options import FastFFNOptions

    family_state = registry.family_state("llama")
    before = family_state.applications
    registry.enable(FastFFNOptions())
    patched = {(owner, name): owner.__dict__.get(name) for owner, name in llama_patch.patched_attributes()}
    hooked = {(owner, name): owner.__dict__.get(name) for owner, name in llama_patch.hooked_attributes()}
    lora_hooks = (LoRAModel.__init__, LoRAModel.save_pretrained)
    model = tiny_model()
    registry.enable(FastFFNOptions())
    assert registry.apply_to_model(model, FastFFNOptions()) == 2
    assert family_state.applications == before + 1
    assert {(o, n): o.__dict__.get(n) for o, n in llama_patch.patched_attributes()} == patched
    assert {(o, n): o.__dict__.get(n) for o, n in llama_patch.hooked_attributes()} == hooked
    assert (LoRAModel.__init__, LoRAModel.save_pretrained) == lora_hooks
    assert modeling.LlamaMLP.forward is llama_patch.fast_mlp_forward
    registry.enable(FastFFNOptions(swiglu=False))  # other options: patched again
    assert family_state.applications == before + 2
    paddle_fastffn.revert_fast_ffn()
    registry.enable(FastFFNOptions())  # after a revert: patched again
    assert family_state.applications == before + 3


@pytest.mark.parametrize("mask", [False, True], ids=["causal", "padding_mask"])
def test_logits_and_all_gradients_match_stock_in_fp32(mask):
    model = tiny_model()
    ids, labels, attention_mask = batch()
    attention_mask = attention_mask if mask else None
    ref_logits = logits_of(model, ids, attention_mask).numpy()
    ref_loss, ref_grads = loss_and_grads(model, ids, labels, attention_mask)
    paddle_fastffn.apply_fast_ffn_to_llama(model)
    logits = logits_of(model, ids, attention_mask).numpy()
    loss, grads = loss_and_grads(model, ids, labels, attention_mask)
    if mask:  # padded query rows differ between attention implementations and are never used
        logits, ref_logits = logits[-1, 2:], ref_logits[-1, 2:]
    assert_close(logits, ref_logits, paddle.float32, "logits")
    assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss)
    assert grads.keys() == ref_grads.keys()
    for name in ref_grads:
        # fp32 reductions over at most a few hundred terms in a different order
        np.testing.assert_allclose(grads[name], ref_grads[name], rtol=2e-4, atol=2e-6, err_msg=name)


def test_each_part_can_be_switched_off():
    model = tiny_model()
    ids, labels, _ = batch()
    ref_loss, _ = loss_and_grads(model, ids, labels)
    for part in ("swiglu", "rms_norm", "rotary", "attention"):
        paddle_fastffn.apply_fast_ffn_to_llama(model, **{part: False})
        loss, _ = loss_and_grads(model, ids, labels)
        assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss), part
        paddle_fastffn.revert_fast_ffn()


def test_fused_projections_load_an_unfused_checkpoint_and_save_one_stock_reads(tmp_path):
    stock = tiny_model()
    stock.save_pretrained(str(tmp_path / "stock"))
    ids, _, mask = batch()
    ref = logits_of(stock, ids, mask).numpy()
    from paddlenlp.transformers import LlamaForCausalLM

    paddle_fastffn.apply_fast_ffn_to_llama()  # fused projections are the default
    fast = LlamaForCausalLM.from_pretrained(str(tmp_path / "stock"))
    assert fast.config.fuse_attention_ffn and fast.config.fuse_attention_qkv
    assert "llama.layers.0.mlp.gate_up_fused_proj.weight" in fast.state_dict()
    assert_close(logits_of(fast, ids, mask).numpy()[-1, 2:], ref[-1, 2:], paddle.float32, "fused load")
    assert_close(logits_of(fast, ids, mask).numpy()[:-1], ref[:-1], paddle.float32, "fused load")
    fast.save_pretrained(str(tmp_path / "fast"))
    paddle_fastffn.revert_fast_ffn()
    back = LlamaForCausalLM.from_pretrained(str(tmp_path / "fast"))  # no overrides: the saved config is stock
    assert not back.config.fuse_attention_ffn and not back.config.use_flash_attention
    assert "llama.layers.0.mlp.gate_proj.weight" in back.state_dict()
    np.testing.assert_allclose(logits_of(back, ids, mask).numpy(), ref, rtol=1e-5, atol=1e-5)


def test_swiglu_recompute_matches_stored_path(kernel_calls):
    model = tiny_model(fuse_attention_ffn=True)
    ids, labels, _ = batch()
    paddle_fastffn.apply_fast_ffn_to_llama(model, swiglu_recompute=False)
    ref_loss, ref_grads = loss_and_grads(model, ids, labels)
    assert kernel_calls()["fastffn_swiglu_bwd_inplace"] == 0
    paddle_fastffn.apply_fast_ffn_to_llama(model, swiglu_recompute=True)
    loss, grads = loss_and_grads(model, ids, labels)
    assert kernel_calls()["fastffn_swiglu_bwd_inplace"] == 2
    assert loss == pytest.approx(ref_loss, rel=1e-6)
    for name in ref_grads:
        np.testing.assert_allclose(grads[name], ref_grads[name], rtol=1e-4, atol=1e-6, err_msg=name)


def test_unsupported_model_is_a_clear_error():
    from paddlenlp.transformers import GPTConfig, GPTForCausalLM

    gpt = GPTForCausalLM(GPTConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                   intermediate_size=64, max_position_embeddings=32))
    with pytest.raises(ValueError, match=r"use_fast_ffn supports LLaMA-style decoder layers.*model_type='gpt'"):
        paddle_fastffn.apply_fast_ffn_to_llama(gpt)


def test_recompute_keeps_working():
    model = tiny_model(recompute=True)
    model.train()
    ids, labels, _ = batch()
    ref_loss, ref_grads = loss_and_grads(model, ids, labels)
    paddle_fastffn.apply_fast_ffn_to_llama(model)
    loss, grads = loss_and_grads(model, ids, labels)
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    for name in ref_grads:
        np.testing.assert_allclose(grads[name], ref_grads[name], rtol=2e-4, atol=2e-6, err_msg=name)


def test_lora_adapters_train_on_the_fast_path_like_stock():
    from paddlenlp.peft import LoRAConfig, LoRAModel

    targets = [".*q_proj.*", ".*k_proj.*", ".*v_proj.*", ".*o_proj.*", ".*gate_proj.*", ".*up_proj.*", ".*down_proj.*"]
    model = LoRAModel(tiny_model(), LoRAConfig(target_modules=targets, r=4, lora_alpha=8, merge_weights=False))
    model.mark_only_lora_as_trainable()
    for name, p in model.named_parameters():  # non-zero B so that adapters change the output
        if "lora_B" in name:
            p.set_value(paddle.randn(p.shape) * 0.05)
    ids, labels, mask = batch()
    ref_loss, ref_grads = loss_and_grads(model, ids, labels, mask)
    paddle_fastffn.apply_fast_ffn_to_llama(model.model)
    loss, grads = loss_and_grads(model, ids, labels, mask)
    lora_grads = [n for n in grads if "lora_" in n]
    assert len(lora_grads) == 2 * 7 * 2 and grads.keys() == ref_grads.keys()
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    for name in lora_grads:
        assert np.abs(grads[name]).max() > 0, name
        np.testing.assert_allclose(grads[name], ref_grads[name], rtol=2e-4, atol=2e-6, err_msg=name)


def test_config_defaults_untouched_without_the_flag():
    config = tiny_config()
    assert not config.use_flash_attention and not config.fuse_attention_ffn


def test_fused_kernels_are_the_ones_running(kernel_calls):
    model = tiny_model()
    paddle_fastffn.apply_fast_ffn_to_llama(model)
    ids, labels, _ = batch()
    loss_and_grads(model, ids, labels)
    # Compiled-op runs, forward and backward. Per layer: 1 SwiGLU, 1 rotary (q and k together),
    # the input norm and the fused add + post-attention norm; plus the model's final norm; and
    # the fused LM head + loss (one chunk: its gradients are computed in the forward).
    # (Built before the patch: gate_proj and up_proj stay unfused, and their two-input SwiGLU writes
    # its gradients over its inputs.)
    assert kernel_calls() == {"fastffn_swiglu_fwd": 2, "fastffn_swiglu_pair_bwd_inplace": 2,
                              "fastffn_rms_norm_fwd": 5, "fastffn_rms_norm_bwd": 5,
                              "fastffn_rotary": 4, "fastffn_cross_entropy": 1}


def test_generate_works_on_paddle3_and_matches_greedy_full_forward_decoding():
    model = tiny_model()
    model.eval()
    paddle_fastffn.apply_fast_ffn_to_llama(model)
    prompt = [5, 6, 7, 8]
    out = model.generate(paddle.to_tensor([prompt]), max_new_tokens=6, decode_strategy="greedy_search")
    generated = out[0].numpy()[0].tolist()
    ids = list(prompt)
    with paddle.no_grad():
        for _ in range(6):
            ids.append(int(paddle.argmax(logits_of(model, paddle.to_tensor([ids]))[0, -1])))
    assert generated == ids[len(prompt):]


def test_generate_with_left_padding_matches_unpadded_generation():
    model = tiny_model(pad_token_id=0, eos_token_id=2)
    model.eval()
    paddle_fastffn.apply_fast_ffn_to_llama(model)
    alone = model.generate(paddle.to_tensor([[5, 6, 7, 8]]), max_new_tokens=5, decode_strategy="greedy_search",
                           pad_token_id=0, eos_token_id=2)[0].numpy()[0]
    padded = model.generate(paddle.to_tensor([[0, 0, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14]]), max_new_tokens=5,
                            decode_strategy="greedy_search", pad_token_id=0, eos_token_id=2)[0].numpy()[0]
    assert padded.tolist() == alone.tolist()


def test_norm_dtype_mismatch_falls_back_to_stock_with_one_warning(recwarn, allow_fallback):
    model = tiny_model()
    paddle_fastffn.apply_fast_ffn_to_llama(model)
    norm = model.llama.norm
    x = paddle.randn([2, 3, 64], dtype="float64")
    for _ in range(3):
        out = norm(x)  # float64 input, float32 weight: PaddleNLP's own math runs
    assert out.dtype == paddle.float32
    messages = [str(w.message) for w in recwarn if "keep PaddleNLP's math" in str(w.message)]
    assert len(messages) == 1
