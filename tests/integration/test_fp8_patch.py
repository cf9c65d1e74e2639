"""fast_ffn_precision=fp8 on the LLaMA patch: arguments, the CPU warning without emulation, and the
emulated FP8 path (training, LoRA, the recipe's layer rules, stock checkpoints)."""

import json
import sys
import warnings

import numpy as np
import paddle
import pytest
from paddlenlp.peft import LoRAConfig, LoRAModel
from paddlenlp.peft.lora.lora_layers import LoRALinear
from paddlenlp.trainer import PdArgumentParser
from paddlenlp.transformers import LlamaForCausalLM

import paddle_fastffn
from llama_fixtures import batch, logits_of, tiny_model, train_steps
from paddle_fastffn.fp8 import Fp8Linear, Fp8Recipe
from paddle_fastffn.integration import enabled_options
from paddle_fastffn.integration import llama as fast_llama
from tolerances import TOLERANCES, assert_close

# Every weight dimension a multiple of 16 (the FP8 GEMM's alignment): the fixture's 172 is not.
FP8_SHAPES = dict(intermediate_size=176)
FP8_EMULATED = dict(precision="fp8", fp8_emulate=True)


def _parse(argv, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["run_finetune.py", *argv])
    parser = PdArgumentParser((paddle_fastffn.FastFFNTrainingArguments,))
    if argv[0].endswith(".json"):
        return parser.parse_json_file_and_cmd_lines()[0]
    return parser.parse_args_into_dataclasses()[0]


def test_precision_and_recipe_parse_from_json_and_command_line(tmp_path, monkeypatch):
    config = tmp_path / "args.json"
    config.write_text(json.dumps({"output_dir": str(tmp_path), "use_fast_ffn": True, "fast_ffn_precision": "fp8",
                                  "fast_ffn_fp8_emulate": True, "fast_ffn_fp8_scaling": "current",
                                  "fast_ffn_fp8_amax_history_len": 16}))
    args = _parse([str(config)], monkeypatch)
    options = args.fast_ffn_options()
    assert options.precision == "fp8" and options.fp8_emulate and enabled_options() == options
    assert options.fp8_recipe() == Fp8Recipe(scaling="current", amax_history_len=16)
    assert fast_llama._FP8 == options.fp8_recipe()  # the patch runs FP8 (emulated)
    paddle_fastffn.revert_fast_ffn()
    args = _parse([str(config), "--fast_ffn_fp8_scaling", "delayed", "--fast_ffn_fp8_margin", "1",
                   "--fast_ffn_fp8_amax_compute_algo", "most_recent", "--fast_ffn_fp8_first_last_bf16", "true",
                   "--fast_ffn_fp8_min_gemm_size", "4096"], monkeypatch)
    assert args.fast_ffn_options().fp8_recipe() == Fp8Recipe(
        scaling="delayed", amax_history_len=16, margin=1.0, amax_compute_algo="most_recent",
        first_last_bf16=True, min_gemm_size=4096)
    paddle_fastffn.revert_fast_ffn()
    defaults = _parse(["--output_dir", str(tmp_path), "--use_fast_ffn", "true"], monkeypatch).fast_ffn_options()
    assert defaults.precision == "bf16" and not defaults.fp8_emulate and defaults.fp8_recipe() == Fp8Recipe()
    assert fast_llama._FP8 is None
    paddle_fastffn.revert_fast_ffn()
    for bad in (["--fast_ffn_precision", "fp4"], ["--fast_ffn_fp8_scaling", "sometimes"],
                ["--fast_ffn_fp8_amax_history_len", "0"]):
        with pytest.raises(ValueError):
            _parse(["--output_dir", str(tmp_path), "--use_fast_ffn", "true", *bad], monkeypatch)


def test_fp8_on_cpu_without_emulation_warns_once_and_keeps_the_bf16_path():
    assert not paddle.is_compiled_with_cuda()
    ids, labels, mask = batch()
    paddle_fastffn.apply_fast_ffn_to_llama()
    reference = logits_of(tiny_model(**FP8_SHAPES), ids, mask).numpy()
    paddle_fastffn.revert_fast_ffn()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        paddle_fastffn.apply_fast_ffn_to_llama(precision="fp8")
        model = tiny_model(**FP8_SHAPES)
        paddle_fastffn.apply_fast_ffn_to_llama(model, precision="fp8")  # enabling again: no second warning
        got = logits_of(model, ids, mask).numpy()
    fp8_warnings = [str(w.message) for w in caught if "fast_ffn_precision=fp8" in str(w.message)]
    assert len(fp8_warnings) == 1 and "needs an NVIDIA Hopper GPU" in fp8_warnings[0], fp8_warnings
    assert "bf16/fp32" in fp8_warnings[0] and "fast_ffn_fp8_emulate" in fp8_warnings[0]
    assert fast_llama._FP8 is None and not fast_llama.fp8_layers(model)
    np.testing.assert_array_equal(got, reference)


@pytest.mark.parametrize("capability, ops_error, emulate, expected", [
    ((9, 0), None, False, "cuda"),
    ((9, 0), None, True, "cuda"),               # the real GEMMs win over emulation where they run
    ((9, 0), "nvcc is not found", False, "fp8_unwired"),
    ((9, 0), "nvcc is not found", True, "emulated"),
    ((8, 0), None, False, "fp8_arch"),
    ((10, 0), None, False, "fp8_arch"),
    (None, None, False, "fp8_arch"),            # a CUDA Paddle without a visible GPU
])
def test_resolve_fp8_on_a_cuda_paddle_by_device_and_operator_build(monkeypatch, info_lines, capability, ops_error,
                                                                    emulate, expected):
    """The decision resolve_fp8 makes on a CUDA build of Paddle, with the device facts given (this
    CPU wheel has none; the selection itself is fp8/cuda.py's unavailable_reason)."""
    from paddle_fastffn.fp8 import cuda as fp8_cuda
    from paddle_fastffn.integration.options import FastFFNOptions

    monkeypatch.setattr(paddle, "is_compiled_with_cuda", lambda: True)
    monkeypatch.setattr(fp8_cuda, "device_capability", lambda device_id=None: capability)
    monkeypatch.setattr(fp8_cuda, "ops_error", lambda: ops_error)
    monkeypatch.setattr(fast_llama, "_FP8_WARNED", set())
    options = FastFFNOptions(precision="fp8", fp8_emulate=emulate)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        recipe = fast_llama.resolve_fp8(options)
    messages = [str(w.message) for w in caught if "fast_ffn_precision=fp8" in str(w.message)]
    if expected in ("cuda", "emulated"):
        assert recipe == options.fp8_recipe() and not messages
        said = "runs cuBLASLt FP8 GEMMs" if expected == "cuda" else "runs emulated"
        assert len(info_lines) == 1 and said in info_lines[0], info_lines
        return
    assert recipe is None and len(messages) == 1 and fast_llama._FP8_WARNED == {expected}
    assert "training in bf16" in messages[0].lower() and "fast_ffn_fp8_emulate" in messages[0]
    if expected == "fp8_unwired":
        assert "nvcc is not found" in messages[0]
    elif capability is not None:
        assert f"sm_{capability[0]}{capability[1]}" in messages[0]


def test_emulated_fp8_trains_close_to_fp32_through_fp8_linear():
    steps = 6
    paddle_fastffn.apply_fast_ffn_to_llama()
    fp32_losses = train_steps(tiny_model(seed=3, **FP8_SHAPES), steps)
    paddle_fastffn.revert_fast_ffn()
    paddle_fastffn.apply_fast_ffn_to_llama(**FP8_EMULATED)
    model = tiny_model(seed=3, **FP8_SHAPES)
    fp8_losses = train_steps(model, steps)
    assert np.isfinite(fp8_losses).all()
    # Each GEMM in FP8 is off by ~2^-4 relative norm-wise (tests/tolerances.py, e4m3); the loss
    # (a mean over tokens of log-softmax) moves far less. Budget: the e4m3 row's rtol on the loss.
    np.testing.assert_allclose(fp8_losses, fp32_losses, rtol=TOLERANCES[paddle.float8_e4m3fn][1])
    assert not np.array_equal(fp8_losses, fp32_losses)  # FP8 rounding did happen
    assert fp8_losses[-1] < fp8_losses[0]
    layers = fast_llama.fp8_layers(model)
    expected = {f"llama.layers.{i}.{name}" for i in range(2) for name in
                ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_fused_proj", "mlp.down_proj")}
    assert set(layers) == expected
    for name, fp8 in layers.items():
        assert isinstance(fp8, Fp8Linear)
        # One weight quantisation per optimizer step (forward and dgrad share it).
        assert fp8.weight_cache.quantizations == steps, name
        assert float(fp8.states.input.amax_history.max()) > 0, name  # inputs were quantised


def test_lora_adapters_train_over_an_fp8_base():
    paddle_fastffn.apply_fast_ffn_to_llama(**FP8_EMULATED)
    targets = [".*q_proj.*", ".*v_proj.*", ".*gate_proj.*", ".*down_proj.*"]
    model = LoRAModel(tiny_model(**FP8_SHAPES), LoRAConfig(target_modules=targets, r=4, lora_alpha=8,
                                                           merge_weights=False))
    model.mark_only_lora_as_trainable()
    for name, p in model.named_parameters():  # non-zero B so that adapters change the output
        if "lora_B" in name:
            p.set_value(paddle.randn(p.shape) * 0.05)
    before = {n: p.numpy().copy() for n, p in model.named_parameters()}
    trainable = [p for p in model.parameters() if not p.stop_gradient]
    train_steps(model, 1, trainable)
    layers = fast_llama.fp8_layers(model)
    lora_layers = {n: f for n, f in layers.items() if type(f.linear) is LoRALinear}
    assert len(lora_layers) == 8, sorted(layers)  # q, v, gate, down in both layers
    assert all(f.linear.weight.stop_gradient for f in lora_layers.values())
    quantized = {n: f.weight_cache.quantizations for n, f in lora_layers.items()}
    losses = train_steps(model, 3, trainable)
    assert np.isfinite(losses).all()
    # The frozen base is quantised once for the run; the adapters trained, the base did not move.
    assert {n: f.weight_cache.quantizations for n, f in lora_layers.items()} == quantized == {n: 1 for n in quantized}
    for name, p in model.named_parameters():
        changed = not np.array_equal(p.numpy(), before[name])
        assert changed is ("lora_" in name), name
    for fp8 in lora_layers.values():
        assert fp8.linear.lora_A.dtype == paddle.float32  # adapters in the activation dtype


def test_first_last_bf16_and_min_gemm_size_are_respected():
    paddle_fastffn.apply_fast_ffn_to_llama(**FP8_EMULATED, fp8_first_last_bf16=True)
    model = tiny_model(num_hidden_layers=3, **FP8_SHAPES)
    ids, labels, mask = batch()
    out = model(ids, attention_mask=mask, output_hidden_states=True, return_dict=True)
    assert len(out.hidden_states) == 4  # LlamaModel's forward keeps all its arguments under the FP8 patch
    layers = fast_llama.fp8_layers(model)
    assert {name.split(".")[2] for name in layers} == {"1"} and len(layers) == 4
    paddle_fastffn.revert_fast_ffn()
    paddle_fastffn.apply_fast_ffn_to_llama(**FP8_EMULATED, fp8_min_gemm_size=10**12)
    model = tiny_model(**FP8_SHAPES)
    reference = logits_of(model, ids, mask)
    layers = fast_llama.fp8_layers(model)
    assert len(layers) == 8 and all(f.weight_cache.quantizations == 0 for f in layers.values())
    paddle_fastffn.revert_fast_ffn()
    paddle_fastffn.apply_fast_ffn_to_llama()
    assert_close(logits_of(model, ids, mask), reference, paddle.float32, "GEMMs below min_gemm_size")


def test_misaligned_widths_warn_once_and_stay_high_precision():
    paddle_fastffn.apply_fast_ffn_to_llama(**FP8_EMULATED)
    model = tiny_model()  # intermediate_size 172
    ids, labels, mask = batch()
    with pytest.warns(UserWarning, match="not a multiple of 16") as caught:
        model(ids, labels=labels, attention_mask=mask)
    assert sum("not a multiple of 16" in str(w.message) for w in caught) == 2  # [64, 344] and [172, 64]
    layers = fast_llama.fp8_layers(model)
    assert {n.rsplit(".", 1)[1] for n in layers} == {"qkv_proj", "o_proj"}


def test_fp8_checkpoint_is_stock_and_loads_in_stock_paddlenlp(tmp_path):
    paddle_fastffn.apply_fast_ffn_to_llama(**FP8_EMULATED)
    model = tiny_model(seed=5, **FP8_SHAPES)
    train_steps(model, 3)
    assert fast_llama.fp8_layers(model)
    assert not any("fp8" in k or "amax" in k or "scale" in k for k in model.state_dict())
    model.save_pretrained(str(tmp_path / "fp8"))
    ids, _, mask = batch(seed=99)
    paddle_fastffn.revert_fast_ffn()
    restored = logits_of(model, ids, mask).numpy()  # the trained parameters, fp32 GEMMs, stock forwards
    stock_layout = {k: v.dtype for k, v in tiny_model(**FP8_SHAPES).state_dict().items()}
    stock = LlamaForCausalLM.from_pretrained(str(tmp_path / "fp8"), use_flash_attention=False)
    assert {k: v.dtype for k, v in stock.state_dict().items()} == stock_layout  # stock names and dtypes
    saved = json.loads((tmp_path / "fp8" / "config.json").read_text())
    assert not saved.get("fuse_attention_qkv") and not saved.get("fuse_attention_ffn")
    assert not any("fp8" in key for key in saved)
    got = logits_of(stock, ids, mask).numpy()
    assert_close(got[:-1], restored[:-1], paddle.float32, "FP8-trained checkpoint in stock PaddleNLP")
    assert_close(got[-1, 2:], restored[-1, 2:], paddle.float32, "FP8-trained checkpoint (padded row)")
