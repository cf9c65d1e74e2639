"""The plugin changes only what it patches, for the models it patches, and revert_fast_ffn() undoes
it: a model of another family built and run next to a patched LLaMA (FP8 included) computes exactly
what it computes without the plugin, and after revert every patched attribute is the original again,
except the hooks that must outlive revert (listed below with their reason)."""

import numpy as np
import paddle
from llama_fixtures import batch, tiny_model

import paddle_fastffn
from paddle_fastffn.fp8 import track_optimizer

FP8_EMULATED = dict(precision="fp8", fp8_emulate=True)


def _patch_points():
    """Every attribute the fast path may replace: {(owner name, attribute): current value}."""
    from paddlenlp.peft.lora.lora_layers import LoRALinear
    from paddlenlp.peft import LoRAModel
    from paddlenlp.trainer import trainer
    from paddlenlp.transformers.llama import modeling

    owners = {"paddle.nn.Linear": paddle.nn.Linear, "LoRALinear": LoRALinear, "LoRAModel": LoRAModel,
              "Trainer": trainer.Trainer, "paddle.Tensor": paddle.Tensor,
              "paddle.optimizer.Optimizer": paddle.optimizer.Optimizer, "llama.modeling": modeling,
              "paddle.nn.Layer": paddle.nn.Layer}
    # The FP8 weight cache's freshness is explicit (fp8/weight_cache.py): no optimizer class is
    # patched for it, only the optimizer objects FP8 training tracks.
    owners.update({f"paddle.optimizer.{name}": getattr(paddle.optimizer, name)
                   for name in ("AdamW", "Adam", "SGD", "Momentum")})
    owners.update({name: getattr(modeling, name) for name in dir(modeling)
                   if name.startswith("Llama") and isinstance(getattr(modeling, name), type)})
    points = {}
    for owner_name, owner in owners.items():
        for attribute, value in vars(owner).items():
            if callable(value) or isinstance(value, (staticmethod, classmethod)):
                points[(owner_name, attribute)] = value
    return points


# Installed once and kept after revert, by design: they act only on models the fast path built
# (fused projections keep the stock checkpoint contract when saved, loaded or given LoRA adapters
# after revert), and Hub folders load through from_pretrained only while the fast path is enabled.
KEPT_AFTER_REVERT = {
    ("LlamaDecoderLayer", "__init__"), ("LlamaPretrainedModel", "_init_weights"),
    ("LlamaPretrainedModel", "save_pretrained"), ("LlamaPretrainedModel", "set_state_dict"),
    ("LlamaForCausalLM", "from_pretrained"), ("LoRAModel", "__init__"), ("LoRAModel", "save_pretrained"),
    # A Trainer resuming a checkpoint of a fused or FP8 model after revert still needs its optimizer
    # state turned to and from the stock layout, and its FP8 state (integration/resume.py).
    ("Trainer", "create_optimizer"), ("Trainer", "_save_checkpoint"), ("Trainer", "_load_optimizer_and_scheduler"),
}


def _gpt_model(state=None):
    """A tiny GPT (no dropout, so a training step is deterministic), with `state`'s weights."""
    from paddlenlp.transformers import GPTConfig, GPTForCausalLM

    model = GPTForCausalLM(GPTConfig(vocab_size=128, hidden_size=64, intermediate_size=172, num_hidden_layers=2,
                                     num_attention_heads=4, max_position_embeddings=32, hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0))
    if state is not None:
        model.set_state_dict(state)
    return model


def _gpt_step(model):
    """Logits and every gradient of one training forward+backward."""
    ids = paddle.to_tensor(np.random.default_rng(0).integers(3, 128, size=(2, 11)), dtype="int64")
    model.train()
    logits = model(ids)
    logits = logits[0] if isinstance(logits, tuple) else logits
    (logits.astype("float32") ** 2).mean().backward()
    grads = {name: p.grad.numpy().copy() for name, p in model.named_parameters() if p.grad is not None}
    model.clear_gradients()
    return logits.numpy(), grads


def test_another_family_is_untouched_and_revert_restores_every_patch(kernel_calls):
    reference = _gpt_model()
    state = {name: value.clone() for name, value in reference.state_dict().items()}
    reference_logits, reference_grads = _gpt_step(reference)
    before = _patch_points()

    for options in ({}, FP8_EMULATED):
        paddle_fastffn.apply_fast_ffn_to_llama(**options)
        llama = tiny_model()  # a patched LLaMA built and trained beside the GPT model
        ids, labels, mask = batch()
        llama(ids, labels=labels, attention_mask=mask)[0].backward()
        optimizer = paddle.optimizer.AdamW(learning_rate=1e-3, parameters=llama.parameters())
        track_optimizer(optimizer).step()  # a stock optimizer tracked for the FP8 weight cache
        llama.set_state_dict(llama.state_dict())  # a checkpoint load: its weights' FP8 copies refresh
        calls_before_gpt = kernel_calls()
        gpt = _gpt_model(state)
        logits, grads = _gpt_step(gpt)
        assert kernel_calls() == calls_before_gpt, "the GPT model ran the plugin's ops"
        np.testing.assert_array_equal(logits, reference_logits)
        assert grads.keys() == reference_grads.keys()
        for name in grads:
            np.testing.assert_array_equal(grads[name], reference_grads[name], err_msg=name)
        assert not [n for n, layer in gpt.named_sublayers() if "forward" in layer.__dict__], \
            "an instance forward was set on the GPT model"
        if options:
            fp8_linears = [layer for layer in llama.sublayers() if "forward" in layer.__dict__]
            assert fp8_linears, "FP8 attaches per Linear instance of the LLaMA layers"
        paddle_fastffn.revert_fast_ffn()
        if options:
            assert not [layer for layer in llama.sublayers() if "forward" in layer.__dict__], \
                "revert leaves FP8 forwards on the LLaMA model's linears"

        after = _patch_points()
        changed = {key for key in before.keys() | after.keys() if before.get(key) is not after.get(key)}
        assert changed <= KEPT_AFTER_REVERT, f"revert_fast_ffn() left these patched: {sorted(changed - KEPT_AFTER_REVERT)}"


def test_attention_off_patches_no_attention_function():
    from paddlenlp.transformers.llama import modeling

    sdpa, generation_mask = modeling.scaled_dot_product_attention, modeling.LlamaForCausalLM.prepare_attention_mask_for_generation
    paddle_fastffn.apply_fast_ffn_to_llama(attention=False)
    assert modeling.scaled_dot_product_attention is sdpa
    assert modeling.LlamaForCausalLM.prepare_attention_mask_for_generation is generation_mask
    paddle_fastffn.apply_fast_ffn_to_llama()
    assert modeling.scaled_dot_product_attention is not sdpa
