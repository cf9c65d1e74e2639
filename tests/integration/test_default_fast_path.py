"""`use_fast_ffn` alone is the benchmarked path: fused qkv / gate_up projections and SwiGLU
recompute wherever they apply, each switchable; what such a model saves is a stock LLaMA
checkpoint; LoRA and tensor parallel keep PaddleNLP's sub-layers with one info line."""

import copy
import json
import re
from functools import partial

import numpy as np
import paddle
import pytest
from paddlenlp.transformers import LlamaForCausalLM

import paddle_fastffn
from llama_fixtures import batch, logits_of, loss_and_grads, tiny_config, tiny_model, train_steps
from paddle_fastffn.integration import llama as llama_patch
from paddle_fastffn.integration import lora
from paddle_fastffn.integration.options import FastFFNOptions
from paddle_fastffn.integration.registry import apply_to_model
from tolerances import assert_close

FUSED = ("llama.layers.0.self_attn.qkv_proj.weight", "llama.layers.0.mlp.gate_up_fused_proj.weight")
UNFUSED = tuple(f"llama.layers.0.{name}.weight" for name in (
    "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"))


@pytest.fixture
def no_fastffn_warnings(recwarn):
    yield
    assert not [str(w.message) for w in recwarn if "paddle_fastffn" in str(w.message)]


def fuse_like(model, arrays: dict) -> dict:
    """Stock-layout arrays in `model`'s fused layout, by PaddleNLP's own fuse mappings."""
    fused, _ = LlamaForCausalLM.convert_fuse_and_split(model.config, dict(arrays))
    return fused


def split_stock(model) -> dict:
    """`model`'s weights in the stock unfused layout, by PaddleNLP's own split mappings."""
    config = copy.deepcopy(model.config)
    config.fuse_attention_qkv = config.fuse_attention_ffn = False
    arrays = {k: v.numpy() for k, v in model.state_dict().items()}
    split, _ = LlamaForCausalLM.convert_fuse_and_split(config, arrays)
    return split


def lora_target_modules(config):
    """scripts/run_finetune.py's targets: PaddleNLP's fused names where the config fuses them."""
    attn = [".*qkv_proj.*"] if config.fuse_attention_qkv else [".*q_proj.*", ".*k_proj.*", ".*v_proj.*"]
    mlp = [".*gate_up_fused_proj.*"] if config.fuse_attention_ffn else [".*gate_proj.*", ".*up_proj.*"]
    return attn + [".*o_proj.*"] + mlp + [".*down_proj.*"]


def test_defaults_are_fused_projections_and_recompute_matching_stock(kernel_calls, info_lines, no_fastffn_warnings):
    assert FastFFNOptions().fuse_projections and FastFFNOptions().swiglu_recompute
    assert not FastFFNOptions().save_fused_checkpoint
    stock = tiny_model(seed=3)
    ids, labels, mask = batch()
    ref_logits = logits_of(stock, ids, mask).numpy()
    ref_loss, ref_grads = loss_and_grads(stock, ids, labels, mask)

    paddle_fastffn.apply_fast_ffn_to_llama()
    fast = tiny_model(seed=3)
    keys = fast.state_dict().keys()
    assert all(k in keys for k in FUSED) and not any(k in keys for k in UNFUSED)
    # The same seed gives the same model: fused weights are drawn as their stock parts.
    expected = fuse_like(fast, {k: v.numpy() for k, v in stock.state_dict().items()})
    for name, value in fast.state_dict().items():
        np.testing.assert_array_equal(value.numpy(), expected[name], err_msg=name)

    logits = logits_of(fast, ids, mask).numpy()
    loss, grads = loss_and_grads(fast, ids, labels, mask)
    assert_close(logits[:-1], ref_logits[:-1], paddle.float32, "logits")
    assert_close(logits[-1, 2:], ref_logits[-1, 2:], paddle.float32, "logits (padded row)")
    assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss)
    ref_grads = fuse_like(fast, ref_grads)
    assert grads.keys() == ref_grads.keys()
    for name in ref_grads:
        # fp32 reductions over at most a few hundred terms in a different order
        np.testing.assert_allclose(grads[name], ref_grads[name], rtol=2e-4, atol=2e-6, err_msg=name)
    calls = kernel_calls()
    # Every layer's MLP took swiglu_down_proj (two forwards, one backward, two layers): the SwiGLU
    # output is recomputed in backward, in place.
    assert calls["fastffn_swiglu_fwd"] == 4 and calls["fastffn_swiglu_bwd_inplace"] == 2
    assert calls["fastffn_swiglu_bwd"] == 0
    assert info_lines == []  # nothing fell back


def test_each_default_can_be_switched_off(tmp_path, kernel_calls, info_lines, no_fastffn_warnings):
    ids, labels, mask = batch()
    stock = tiny_model(seed=3)
    ref_loss, _ = loss_and_grads(stock, ids, labels, mask)

    paddle_fastffn.apply_fast_ffn_to_llama(fuse_projections=False)
    unfused = tiny_model(seed=3)
    assert all(k in unfused.state_dict() for k in UNFUSED) and not unfused.config.fuse_attention_ffn
    for _ in range(2):
        loss, _ = loss_and_grads(unfused, ids, labels, mask)
    assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss)
    # Recompute needs the fused gate/up projection: one info line, no warning, the stored path.
    assert len(info_lines) == 1 and "swiglu_recompute needs the fused gate/up projection" in info_lines[0]
    assert kernel_calls()["fastffn_swiglu_bwd_inplace"] == 0
    paddle_fastffn.revert_fast_ffn()

    before = kernel_calls()
    paddle_fastffn.apply_fast_ffn_to_llama(swiglu_recompute=False)
    stored = tiny_model(seed=3)
    assert all(k in stored.state_dict() for k in FUSED)
    loss, _ = loss_and_grads(stored, ids, labels, mask)
    assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss)
    calls = kernel_calls() - before
    assert calls["fastffn_swiglu_bwd"] == 2 and calls["fastffn_swiglu_bwd_inplace"] == 0
    paddle_fastffn.revert_fast_ffn()

    paddle_fastffn.apply_fast_ffn_to_llama(save_fused_checkpoint=True)
    fused = tiny_model(seed=3)
    fused.save_pretrained(str(tmp_path / "fused"))
    saved = paddle.load(str(tmp_path / "fused" / "model_state.pdparams"))
    assert all(k in saved for k in FUSED) and not any(k in saved for k in UNFUSED)
    config = json.loads((tmp_path / "fused" / "config.json").read_text())
    assert config["fuse_attention_qkv"] and config["fuse_attention_ffn"]
    assert not config.get("use_flash_attention", False)  # a runtime choice of the patch, not the checkpoint's
    paddle_fastffn.revert_fast_ffn()
    back = LlamaForCausalLM.from_pretrained(str(tmp_path / "fused"))  # PaddleNLP's fused layout
    assert_close(logits_of(back, ids, mask).numpy()[:-1], logits_of(stock, ids, mask).numpy()[:-1],
                 paddle.float32, "fused checkpoint in stock PaddleNLP")


@pytest.mark.parametrize("safe_serialization", [False, True], ids=["pdparams", "safetensors"])
def test_fast_model_saves_a_stock_checkpoint_that_stock_paddlenlp_loads(tmp_path, safe_serialization,
                                                                        no_fastffn_warnings):
    stock_keys = set(tiny_model().state_dict())
    paddle_fastffn.apply_fast_ffn_to_llama()
    fast = tiny_model(seed=5)
    train_steps(fast, 3, batches=3)
    ids, _, mask = batch(seed=99)
    fast_logits = logits_of(fast, ids, mask).numpy()
    expected = split_stock(fast)
    fast.save_pretrained(str(tmp_path / "out"), safe_serialization=safe_serialization)
    # The model itself keeps training on its fused layers.
    assert all(k in fast.state_dict() for k in FUSED) and fast.config.fuse_attention_ffn

    if safe_serialization:
        from safetensors.numpy import load_file

        saved = load_file(str(tmp_path / "out" / "model.safetensors"))
    else:
        saved = {k: np.asarray(v) for k, v in paddle.load(str(tmp_path / "out" / "model_state.pdparams"),
                                                          return_numpy=True).items()}
    assert set(saved) == stock_keys
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert not config.get("fuse_attention_qkv", False) and not config.get("fuse_attention_ffn", False)
    assert not config.get("use_flash_attention", False)
    # Stock names are what PaddleNLP's Hugging Face name mappings cover, one to one.
    saved_config = LlamaForCausalLM.config_class.from_pretrained(str(tmp_path / "out"))
    mapped = {m.target_name for m in LlamaForCausalLM._get_name_mappings(saved_config)}
    assert set(saved) <= mapped

    paddle_fastffn.revert_fast_ffn()
    back = LlamaForCausalLM.from_pretrained(str(tmp_path / "out"))
    assert not back.config.fuse_attention_qkv and not back.config.use_flash_attention
    for name, value in back.state_dict().items():
        np.testing.assert_array_equal(value.numpy(), expected[name], err_msg=name)
    back_logits = logits_of(back, ids, mask).numpy()
    assert_close(back_logits[:-1], fast_logits[:-1], paddle.float32, "fast checkpoint in stock PaddleNLP")
    assert_close(back_logits[-1, 2:], fast_logits[-1, 2:], paddle.float32, "fast checkpoint (padded row)")


def test_stock_layout_state_dict_loads_into_the_fused_model(tmp_path):
    """The Trainer's resume and best-model reload call set_state_dict with what save_pretrained
    wrote (no from_pretrained conversion in between)."""
    paddle_fastffn.apply_fast_ffn_to_llama()
    trained = tiny_model(seed=5)
    train_steps(trained, 3, batches=3)
    trained.save_pretrained(str(tmp_path / "ckpt"))
    fresh = tiny_model(seed=6)
    state = paddle.load(str(tmp_path / "ckpt" / "model_state.pdparams"), return_numpy=True)
    assert not any(k in state for k in FUSED)
    fresh.set_state_dict(state)
    for name, value in trained.state_dict().items():
        np.testing.assert_array_equal(fresh.state_dict()[name].numpy(), value.numpy(), err_msg=name)


def test_fused_model_generates_like_greedy_full_forward_decoding(no_fastffn_warnings):
    paddle_fastffn.apply_fast_ffn_to_llama()
    model = tiny_model()
    model.eval()
    assert model.config.fuse_attention_qkv
    prompt = [5, 6, 7, 8]
    out = model.generate(paddle.to_tensor([prompt]), max_new_tokens=6, decode_strategy="greedy_search")
    ids = list(prompt)
    with paddle.no_grad():
        for _ in range(6):
            ids.append(int(paddle.argmax(logits_of(model, paddle.to_tensor([ids]))[0, -1])))
    assert out[0].numpy()[0].tolist() == ids[len(prompt):]


def _lora(model, targets):
    from paddlenlp.peft import LoRAConfig, LoRAModel

    paddle.seed(11)  # adapters' initial A
    lora = LoRAModel(model, LoRAConfig(target_modules=targets, r=4, lora_alpha=8, merge_weights=False))
    lora.mark_only_lora_as_trainable()
    paddle.seed(12)
    for name, p in lora.named_parameters():  # non-zero B so that adapters change the output
        if "lora_B" in name:
            p.set_value(paddle.randn(p.shape) * 0.05)
    return lora


def test_lora_in_run_finetune_order_gets_the_stock_sub_layers_and_trains_like_stock(tmp_path, info_lines,
                                                                                   no_fastffn_warnings):
    """run_finetune.py: the TrainingArguments enable the fast path, the model is built (fused),
    apply_to_model, then LoRAModel wraps it with targets named after the config's layout."""
    tiny_model(seed=1).save_pretrained(str(tmp_path / "base"))
    ids, labels, mask = batch()

    stock = _lora(LlamaForCausalLM.from_pretrained(str(tmp_path / "base")), lora_target_modules(tiny_config()))
    ref_loss, ref_grads = loss_and_grads(stock, ids, labels, mask)
    stock.save_pretrained(str(tmp_path / "lora_stock"))

    paddle_fastffn.apply_fast_ffn_to_llama()
    model = LlamaForCausalLM.from_pretrained(str(tmp_path / "base"))
    apply_to_model(model, FastFFNOptions())
    targets = lora_target_modules(model.config)
    assert targets[0] == ".*qkv_proj.*"  # what run_finetune.py asks for on the fused model
    fast = _lora(model, targets)
    assert fast.lora_config.target_modules == lora_target_modules(tiny_config())
    assert not model.config.fuse_attention_qkv and not model.config.fuse_attention_ffn
    attn, mlp = model.llama.layers[0].self_attn, model.llama.layers[0].mlp
    assert [n for n, _ in attn.named_children()][:4] == ["q_proj", "k_proj", "v_proj", "o_proj"]
    assert [n for n, _ in mlp.named_children()] == ["gate_proj", "up_proj", "down_proj"]
    loss, grads = loss_and_grads(fast, ids, labels, mask)
    assert len([n for n in grads if "lora_" in n]) == 2 * 7 * 2 and grads.keys() == ref_grads.keys()
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    for name in ref_grads:
        assert np.abs(ref_grads[name]).max() > 0, name
        np.testing.assert_allclose(grads[name], ref_grads[name], rtol=2e-4, atol=2e-6, err_msg=name)
    assert len(info_lines) == 1 and "LoRA adapts" in info_lines[0]

    fast.save_pretrained(str(tmp_path / "lora_fast"))
    for name in ("lora_config.json", "config.json"):
        assert (json.loads((tmp_path / "lora_fast" / name).read_text())
                == json.loads((tmp_path / "lora_stock" / name).read_text())), name
    saved = paddle.load(str(tmp_path / "lora_fast" / "lora_model_state.pdparams"))
    assert saved.keys() == paddle.load(str(tmp_path / "lora_stock" / "lora_model_state.pdparams")).keys()


def test_lora_on_down_proj_only_keeps_fused_gate_up_and_stores_the_swiglu_output(info_lines, no_fastffn_warnings):
    ids, labels, mask = batch()
    stock = _lora(tiny_model(seed=2), [".*down_proj.*"])
    ref_loss, ref_grads = loss_and_grads(stock, ids, labels, mask)

    paddle_fastffn.apply_fast_ffn_to_llama()
    model = tiny_model(seed=2)
    fast = _lora(model, [".*down_proj.*"])
    assert model.config.fuse_attention_ffn  # no adapter on gate/up: they stay fused
    for _ in range(2):
        loss, grads = loss_and_grads(fast, ids, labels, mask)
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    for name in ref_grads:
        np.testing.assert_allclose(grads[name], ref_grads[name], rtol=2e-4, atol=2e-6, err_msg=name)
    assert len(info_lines) == 1 and "swiglu_recompute needs a plain Linear down_proj" in info_lines[0]


@pytest.mark.parametrize("degree", ["tensor_parallel_degree", "pipeline_parallel_degree"])
def test_distributed_configs_keep_the_sharded_sub_layers_with_one_info_line(degree, info_lines):
    config = tiny_config(**{degree: 2})
    for _ in range(config.num_hidden_layers):  # the construction hook calls it per decoder layer
        llama_patch.configure(config, FastFFNOptions())
    assert not config.fuse_attention_qkv and not config.fuse_attention_ffn
    assert config.use_flash_attention
    assert len(info_lines) == 1 and f"{degree}=2" in info_lines[0]
    assert "own (sharded) q/k/v and gate/up projection sub-layers" in info_lines[0]


def test_a_model_built_before_enabling_keeps_its_projections_with_one_info_line(info_lines, no_fastffn_warnings):
    model = tiny_model()
    paddle_fastffn.apply_fast_ffn_to_llama(model)
    ids, labels, _ = batch()
    loss_and_grads(model, ids, labels)
    assert not model.config.fuse_attention_ffn
    assert len(info_lines) == 1 and "built before the fast path was enabled" in info_lines[0]


def test_trainer_saves_stock_checkpoints_and_resumes_them_into_the_fused_model(tmp_path, monkeypatch):
    """PaddleNLP's Trainer: checkpoint-N and save_model() go through save_pretrained (stock layout);
    resuming reads them with set_state_dict into the fused model the fast path builds again."""
    from paddlenlp.trainer import PdArgumentParser, Trainer

    rng = np.random.default_rng(0)
    rows = [{"input_ids": ids, "labels": ids} for ids in rng.integers(3, 128, size=(8, 12)).tolist()]

    def fast_args(out):
        parser = PdArgumentParser((paddle_fastffn.FastFFNTrainingArguments,))
        return parser.parse_dict(dict(output_dir=str(out), use_fast_ffn=True, max_steps=2, save_steps=1,
                                      save_strategy="steps", per_device_train_batch_size=4, learning_rate=1e-2,
                                      logging_steps=1, report_to="none", device="cpu", disable_tqdm=True,
                                      seed=7))[0]

    stock_keys = set(tiny_model().state_dict())
    args = fast_args(tmp_path / "run")  # enables the fast path
    model = tiny_model(seed=4)
    assert model.config.fuse_attention_ffn
    Trainer(model=model, args=args, train_dataset=rows).train()
    Trainer(model=model, args=args).save_model()
    for folder in ("checkpoint-1", "checkpoint-2", "."):
        saved = paddle.load(str(tmp_path / "run" / folder / "model_state.pdparams"), return_numpy=True)
        assert set(saved) == stock_keys, folder
        config = json.loads((tmp_path / "run" / folder / "config.json").read_text())
        assert not config.get("fuse_attention_ffn", False) and not config.get("use_flash_attention", False)

    paddle_fastffn.revert_fast_ffn()
    args = fast_args(tmp_path / "resume")
    resumed = tiny_model(seed=9)  # built again on the fast path: fused
    trainer = Trainer(model=resumed, args=args, train_dataset=rows)
    trainer._load_from_checkpoint(str(tmp_path / "run" / "checkpoint-1"))
    checkpoint = paddle.load(str(tmp_path / "run" / "checkpoint-1" / "model_state.pdparams"), return_numpy=True)
    expected = fuse_like(resumed, checkpoint)
    for name, value in resumed.state_dict().items():
        np.testing.assert_array_equal(value.numpy(), np.asarray(expected[name]), err_msg=name)


def test_lora_patterns_naming_fused_layers_are_aimed_at_their_stock_parts():
    fused = {"llama.layers.0.self_attn.qkv_proj": "qkv", "llama.layers.0.mlp.gate_up_fused_proj": "ffn"}
    others = ["llama.layers.0.self_attn", "llama.layers.0.self_attn.o_proj", "llama.layers.0.mlp",
              "llama.layers.0.mlp.down_proj"]
    retarget = partial(lora.retarget, layouts=llama_patch.FUSED_LAYOUTS)
    # run_finetune.py's fused names become PaddleNLP's stock list, in its order (adapters are
    # created, and their A drawn, in the order stock creates them).
    assert retarget([".*qkv_proj.*", ".*o_proj.*", ".*gate_up_fused_proj.*", ".*down_proj.*"], [None] * 4,
                    fused, others)[0] == [".*q_proj.*", ".*k_proj.*", ".*v_proj.*", ".*o_proj.*", ".*gate_proj.*",
                                          ".*up_proj.*", ".*down_proj.*"]
    # A list naming both the fused layer and its parts (PaddleNLP's llm get_lora_target_modules does for
    # some families) targets each part once: LoRAModel would otherwise adapt it twice, shifting the
    # adapters' names and random draws away from stock's.
    assert retarget([".*qkv_proj.*", ".*q_proj.*", ".*k_proj.*", ".*v_proj.*", ".*o_proj.*"], [None] * 5,
                    fused, others)[0] == [".*q_proj.*", ".*k_proj.*", ".*v_proj.*", ".*o_proj.*"]
    # Patterns that already name stock layers keep their stock meaning (".*v_proj.*" also matches
    # "qkv_proj", but on the stock model it means v_proj only).
    assert retarget([".*v_proj.*"], [None], fused, others)[0] == [".*v_proj.*"]
    # A merged-LoRA enable list on the fused layer keeps the enabled parts only.
    assert retarget([".*qkv_proj.*"], [[True, False, True]], fused, others) == ([".*q_proj.*", ".*v_proj.*"],
                                                                               [None, None])
    # Per-part patterns would match o_proj three times: one alternation instead.
    assert retarget([".*self_attn.(qkv_proj|o_proj)"], [None], fused, others)[0] == [
        ".*self_attn.((?:q_proj|k_proj|v_proj)|o_proj)"]
    # A pattern matching the fused layer by another route gets its parts by name.
    (pattern,), _ = retarget([".*qkv.*"], [None], fused, others)
    assert all(re.fullmatch(pattern, f"llama.layers.0.self_attn.{p}_proj") for p in "qkv")
