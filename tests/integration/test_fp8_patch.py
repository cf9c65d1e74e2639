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
from helpers import fp8_heads_made
from llama_fixtures import batch, logits_of, tiny_model, train_steps
from paddle_fastffn.fp8 import Fp8FFN, Fp8Linear, Fp8Recipe, track_optimizer, weights_updated
from paddle_fastffn.integration import enabled_options, fp8_attach
from paddle_fastffn.integration import llama as fast_llama
from paddle_fastffn.integration import messages as fast_messages
from paddle_fastffn.optim import FastAdamW
from tolerances import FP8_TRAINING_LOSS_RTOL, TOLERANCES, assert_close

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
    assert fast_llama.fp8_recipe() == options.fp8_recipe()  # the patch runs FP8 (emulated)
    paddle_fastffn.revert_fast_ffn()
    args = _parse([str(config), "--fast_ffn_fp8_scaling", "delayed", "--fast_ffn_fp8_margin", "1",
                   "--fast_ffn_fp8_amax_compute_algo", "most_recent", "--fast_ffn_fp8_first_last_bf16", "true",
                   "--fast_ffn_fp8_min_gemm_size", "4096", "--fast_ffn_fp8_delayed_warm_start", "false",
                   "--fast_ffn_fp8_saved_gate_up", "activation"], monkeypatch)
    assert args.fast_ffn_options().fp8_recipe() == Fp8Recipe(
        scaling="delayed", amax_history_len=16, margin=1.0, amax_compute_algo="most_recent",
        first_last_bf16=True, min_gemm_size=4096, delayed_warm_start=False, saved_gate_up="activation")
    paddle_fastffn.revert_fast_ffn()
    defaults = _parse(["--output_dir", str(tmp_path), "--use_fast_ffn", "true"], monkeypatch).fast_ffn_options()
    assert defaults.precision == "bf16" and not defaults.fp8_emulate and defaults.fp8_recipe() == Fp8Recipe()
    assert fast_llama.fp8_recipe() is None
    paddle_fastffn.revert_fast_ffn()
    for bad in (["--fast_ffn_precision", "fp4"], ["--fast_ffn_fp8_scaling", "sometimes"],
                ["--fast_ffn_fp8_amax_history_len", "0"], ["--fast_ffn_fp8_saved_gate_up", "bf16"]):
        with pytest.raises(ValueError):
            _parse(["--output_dir", str(tmp_path), "--use_fast_ffn", "true", *bad], monkeypatch)


def test_fp8_on_cpu_without_emulation_is_an_error_before_anything_is_patched():
    from paddle_fastffn.integration import state
    from paddle_fastffn.integration.fp8_attach import Fp8UnavailableError

    assert not paddle.is_compiled_with_cuda()
    with pytest.raises(Fp8UnavailableError, match=r"^fast_ffn_precision=fp8 needs an NVIDIA Hopper GPU \(sm_90\) "
                                                  r"and this Paddle build has no GPU: set fast_ffn_fp8_emulate=true"):
        paddle_fastffn.apply_fast_ffn_to_llama(precision="fp8")
    assert state.current() is None and fast_llama.fp8_recipe() is None  # nothing enabled


def test_fp8_fallback_bf16_on_cpu_warns_once_keeps_the_bf16_path_and_says_why():
    from paddle_fastffn.integration.fp8_attach import fp8_fallback_reason
    from paddle_fastffn.integration.report import fast_path_report

    assert not paddle.is_compiled_with_cuda()
    ids, labels, mask = batch()
    paddle_fastffn.apply_fast_ffn_to_llama()
    reference = logits_of(tiny_model(**FP8_SHAPES), ids, mask).numpy()
    assert fp8_fallback_reason() is None
    paddle_fastffn.revert_fast_ffn()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        paddle_fastffn.apply_fast_ffn_to_llama(precision="fp8", fp8_fallback="bf16")
        model = tiny_model(**FP8_SHAPES)
        # enabling again: no second warning
        paddle_fastffn.apply_fast_ffn_to_llama(model, precision="fp8", fp8_fallback="bf16")
        got = logits_of(model, ids, mask).numpy()
    fp8_warnings = [str(w.message) for w in caught if "fast_ffn_precision=fp8" in str(w.message)]
    assert len(fp8_warnings) == 1 and "needs an NVIDIA Hopper GPU" in fp8_warnings[0], fp8_warnings
    assert "bf16/fp32" in fp8_warnings[0] and "fast_ffn_fp8_emulate" in fp8_warnings[0]
    assert fast_llama.fp8_recipe() is None and not fast_llama.fp8_layers(model)
    np.testing.assert_array_equal(got, reference)
    assert fp8_fallback_reason() == ("fast_ffn_precision=fp8 needs an NVIDIA Hopper GPU (sm_90) and this Paddle "
                                     "build has no GPU: training in bf16/fp32 (fast_ffn_fp8_fallback=bf16)")
    assert fp8_fallback_reason() in fast_path_report(model)["notes"]


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
    monkeypatch.setattr(fast_messages, "_FP8_WARNED", set())
    if expected not in ("cuda", "emulated"):
        from paddle_fastffn.integration.fp8_attach import Fp8UnavailableError

        with pytest.raises(Fp8UnavailableError, match="fast_ffn_fp8_fallback=bf16 to train in bf16 instead"):
            fast_llama.resolve_fp8(FastFFNOptions(precision="fp8", fp8_emulate=emulate))
        assert not fast_messages._FP8_WARNED
    options = FastFFNOptions(precision="fp8", fp8_emulate=emulate, fp8_fallback="bf16")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        recipe = fast_llama.resolve_fp8(options)
    messages = [str(w.message) for w in caught if "fast_ffn_precision=fp8" in str(w.message)]
    if expected in ("cuda", "emulated"):
        assert recipe == options.fp8_recipe() and not messages
        said = "runs cuBLASLt FP8 GEMMs" if expected == "cuda" else "runs emulated"
        assert len(info_lines) == 1 and said in info_lines[0], info_lines
        return
    assert recipe is None and len(messages) == 1 and fast_messages._FP8_WARNED == {expected}
    assert "training in bf16" in messages[0].lower() and "fast_ffn_fp8_emulate" in messages[0]
    if expected == "fp8_unwired":
        assert "nvcc is not found" in messages[0]
    elif capability is not None:
        assert f"sm_{capability[0]}{capability[1]}" in messages[0]


def test_emulated_fp8_trains_close_to_fp32_through_the_fp8_ffn_and_fp8_linear():
    steps = 6
    paddle_fastffn.apply_fast_ffn_to_llama()
    fp32_losses = train_steps(tiny_model(seed=3, **FP8_SHAPES), steps)
    paddle_fastffn.revert_fast_ffn()
    # The trained weights' FP8 copies cached (quantised once a step, held) give the same run bit
    # for bit as the default, per use (quantised by each GEMM, none held).
    paddle_fastffn.apply_fast_ffn_to_llama(**FP8_EMULATED, fp8_weight_copies="cached")
    cached = tiny_model(seed=3, **FP8_SHAPES)
    cached_losses = train_steps(cached, steps)
    cached_quantizations = {name: fp8.weight_cache.quantizations for name, fp8 in fast_llama.fp8_layers(cached).items()}
    paddle_fastffn.revert_fast_ffn()
    paddle_fastffn.apply_fast_ffn_to_llama(**FP8_EMULATED)
    model = tiny_model(seed=3, **FP8_SHAPES)
    fp8_losses = train_steps(model, steps)
    np.testing.assert_array_equal(fp8_losses, cached_losses)
    assert np.isfinite(fp8_losses).all()
    # Each GEMM in FP8 is off by ~2^-4 relative norm-wise (tests/tolerances.py, e4m3); the loss
    # (a mean over tokens of log-softmax) moves far less. Budget: the e4m3 row's rtol on the loss.
    np.testing.assert_allclose(fp8_losses, fp32_losses, rtol=TOLERANCES[paddle.float8_e4m3fn][1])
    assert not np.array_equal(fp8_losses, fp32_losses)  # FP8 rounding did happen
    assert fp8_losses[-1] < fp8_losses[0]
    layers = fast_llama.fp8_layers(model)
    # The MLP is one FP8 FFN (the composition the GPU benchmarks time), the attention projections
    # FP8 linears; the MLP's own Linears carry no FP8 object.
    expected = {f"llama.layers.{i}.{name}" for i in range(2) for name in
                ("self_attn.qkv_proj", "self_attn.o_proj", "mlp")}
    assert set(layers) == expected
    for name, fp8 in layers.items():
        ffn = name.endswith("mlp")
        assert isinstance(fp8, Fp8FFN if ffn else Fp8Linear), name
        # Per use: no FP8 weight copy is kept; cached: one quantisation per weight and optimizer step
        # (forward and dgrad share it).
        assert fp8.weight_cache.quantizations == 0 and not fp8.weight_cache.cached(), name
        assert cached_quantizations[name] == (2 if ffn else 1) * steps, name
        inputs = fp8.states.x if ffn else fp8.states.input
        assert float(inputs.amax_history.max()) > 0, name  # inputs were quantised


def _one_step(model, optimizer):
    ids, labels, mask = batch(seed=1)
    model(ids, labels=labels, attention_mask=mask)[0].backward()
    optimizer.step()
    optimizer.clear_grad()


def _set_value_by_hand(model):
    with paddle.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("qkv_proj.weight", "down_proj.weight")):
                p.set_value(p * 1.5)
    weights_updated(model)  # the hand-written loop says so (fp8/weight_cache.py)


# Every supported way of changing weights under FP8 (docs/usage.md, FP8): a tracked stock
# optimizer, FastAdamW, a checkpoint load, a hand write followed by weights_updated.
WEIGHT_CHANGES = {
    "stock_optimizer_step": lambda model: _one_step(model, track_optimizer(
        paddle.optimizer.AdamW(learning_rate=1e-2, parameters=model.parameters()))),
    "fast_adamw_step": lambda model: _one_step(model, FastAdamW(learning_rate=1e-2, parameters=model.parameters())),
    "set_state_dict": lambda model: model.set_state_dict(tiny_model(seed=5, **FP8_SHAPES).state_dict()),
    "set_value_then_weights_updated": _set_value_by_hand,
}


@pytest.mark.parametrize("change", sorted(WEIGHT_CHANGES))
def test_the_fp8_forward_uses_weights_changed_in_each_supported_way(change):
    """No stale FP8 weight copy: after the change, the FP8 model computes what a fresh FP8 model
    with the new weights computes (current scaling, so no scaling history tells them apart)."""
    paddle_fastffn.apply_fast_ffn_to_llama(**FP8_EMULATED, fp8_scaling="current")
    model = tiny_model(seed=3, **FP8_SHAPES)
    ids, _, mask = batch()
    before = logits_of(model, ids, mask).numpy()  # caches every FP8 weight copy
    WEIGHT_CHANGES[change](model)
    after = logits_of(model, ids, mask).numpy()
    fresh = tiny_model(seed=4, **FP8_SHAPES)
    fresh.set_state_dict(model.state_dict())
    np.testing.assert_array_equal(after, logits_of(fresh, ids, mask).numpy(), err_msg=change)
    assert not np.array_equal(after, before), f"{change} changed no weight the forward reads"


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
    # The frozen base is held only in FP8 (fast_ffn_fp8_frozen_weights' default), quantised once for
    # the run; the adapters trained, the base did not move.
    quantized = lambda: {n: (f.frozen_quantizations, f.weight_cache.quantizations)  # noqa: E731
                         for n, f in lora_layers.items()}
    before_steps = quantized()
    losses = train_steps(model, 3, trainable)
    assert np.isfinite(losses).all()
    assert all(f.holds_frozen_weight() for f in lora_layers.values())
    assert quantized() == before_steps == {n: (1, 0) for n in lora_layers}
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
    assert {name.split(".")[2] for name in layers} == {"1"} and len(layers) == 3  # qkv, o and the FFN
    paddle_fastffn.revert_fast_ffn()
    paddle_fastffn.apply_fast_ffn_to_llama(**FP8_EMULATED, fp8_min_gemm_size=10**12)
    model = tiny_model(**FP8_SHAPES)
    reference = logits_of(model, ids, mask)
    layers = fast_llama.fp8_layers(model)
    assert len(layers) == 6 and all(f.weight_cache.quantizations == 0 for f in layers.values())
    paddle_fastffn.revert_fast_ffn()
    paddle_fastffn.apply_fast_ffn_to_llama()
    assert_close(logits_of(model, ids, mask), reference, paddle.float32, "GEMMs below min_gemm_size")


def test_misaligned_widths_warn_once_and_stay_high_precision():
    paddle_fastffn.apply_fast_ffn_to_llama(**FP8_EMULATED)
    model = tiny_model()  # intermediate_size 172
    ids, labels, mask = batch()
    with pytest.warns(UserWarning, match="multiples of 16") as caught:
        model(ids, labels=labels, attention_mask=mask)
        model(ids, labels=labels, attention_mask=mask)
    messages = [str(w.message) for w in caught if "multiple" in str(w.message)]
    assert len(messages) == 1 and "intermediate size 172" in messages[0], messages  # one for the FFN
    layers = fast_llama.fp8_layers(model)
    assert {n.rsplit(".", 1)[1] for n in layers} == {"qkv_proj", "o_proj"}
    unfused = LoRAModel(tiny_model(), LoRAConfig(target_modules=[".*gate_proj.*"], r=4))  # per-linear MLPs
    with pytest.warns(UserWarning, match="not a multiple of 16") as caught:
        unfused(ids, labels=labels, attention_mask=mask)
    assert sum("not a multiple of 16" in str(w.message) for w in caught) == 2  # [64, 172] and [172, 64]


def test_the_mlp_runs_the_fp8_ffn_where_its_projections_are_fused_plain_linears(info_lines):
    """The default fused MLP runs the FP8 FFN; an MLP with LoRA on down_proj (gate_up stays fused)
    or with unfused gate/up (LoRA on them) runs Fp8Linear per linear; one info line per path."""
    paddle_fastffn.apply_fast_ffn_to_llama(**FP8_EMULATED)
    ids, labels, mask = batch()
    model = tiny_model(**FP8_SHAPES)
    model(ids, labels=labels, attention_mask=mask)
    ffns = {n: f for n, f in fast_llama.fp8_layers(model).items() if isinstance(f, Fp8FFN)}
    assert set(ffns) == {"llama.layers.0.mlp", "llama.layers.1.mlp"}
    assert ffns["llama.layers.0.mlp"].gate_up is model.llama.layers[0].mlp.gate_up_fused_proj
    assert sum("run the FP8 FFN" in line for line in info_lines) == 1, info_lines

    for targets, mlp_linears, why in (([".*down_proj.*"], {"gate_up_fused_proj", "down_proj"}, "LoRALinear"),
                                      ([".*gate_proj.*"], {"gate_proj", "up_proj", "down_proj"}, "unfused")):
        lora = LoRAModel(tiny_model(**FP8_SHAPES), LoRAConfig(target_modules=targets, r=4, merge_weights=False))
        lora(ids, labels=labels, attention_mask=mask)
        layers = fast_llama.fp8_layers(lora)
        assert not any(isinstance(f, Fp8FFN) for f in layers.values()), targets
        assert {n.rsplit(".", 1)[1] for n in layers if ".mlp." in n} == mlp_linears, sorted(layers)
        per_linear = [line for line in info_lines if "run Fp8Linear each" in line and why in line]
        assert len(per_linear) == 1, info_lines


def test_delayed_scaling_warm_start_tracks_fp32_from_the_first_steps():
    """Delayed scaling with the warm start (the default) follows the fp32 losses from step 0; TE's
    exact start (every scale 1) lags behind while its calibration creeps in. The loss is scaled by
    2^-10, the per-token gradients of a batch of 40k tokens (this one has 39; AdamW with a tiny
    epsilon is invariant to that scale): at a scale of 1, e5m2 then flushes most gradients to zero
    (below 2^-17). Measured over these 6 steps: warm start within 0.3% of fp32, TE 2.5% off."""
    def train(**options):
        paddle_fastffn.apply_fast_ffn_to_llama(**options)
        model = tiny_model(seed=3, **FP8_SHAPES)
        optimizer = track_optimizer(paddle.optimizer.AdamW(learning_rate=3e-3, parameters=model.parameters(),
                                                           weight_decay=0.01, epsilon=1e-12))
        losses = []
        for step in range(6):
            ids, labels, mask = batch(seed=step % 2)
            loss = model(ids, labels=labels, attention_mask=mask)[0]
            (loss * 2.0**-10).backward()
            optimizer.step()
            optimizer.clear_grad()
            losses.append(float(loss))
        paddle_fastffn.revert_fast_ffn()
        return np.array(losses), model

    fp32, _ = train()
    warm, model = train(**FP8_EMULATED, fp8_scaling="delayed")
    te, _ = train(**FP8_EMULATED, fp8_scaling="delayed", fp8_delayed_warm_start=False)
    np.testing.assert_allclose(warm, fp32, rtol=FP8_TRAINING_LOSS_RTOL)
    assert np.abs(te / fp32 - 1).max() > FP8_TRAINING_LOSS_RTOL, (te, fp32)  # the failure the warm start fixes
    for name, fp8 in fast_llama.fp8_layers(model).items():
        for role in fp8.states.roles():
            state = getattr(fp8.states, role)
            assert state.seeded and float(state.amax_history.max()) > 0, (name, role)


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


def _train_fp8_delayed(recompute: str | None, steps=4):
    """Emulated FP8 (delayed scaling, history 4) on the tiny LLaMA, PaddleNLP's full-layer
    recompute off (None), reentrant or not: the per-step losses, and every FP8 state's amax
    history and scale after the run, by layer and role."""
    paddle_fastffn.apply_fast_ffn_to_llama(**FP8_EMULATED, fp8_scaling="delayed", fp8_amax_history_len=4)
    model = tiny_model(seed=11, **FP8_SHAPES)
    if recompute is not None:
        model.config.recompute_granularity = "full"
        model.config.recompute_use_reentrant = recompute == "reentrant"
        model.llama.enable_recompute = True
    optimizer = track_optimizer(paddle.optimizer.SGD(learning_rate=0.05, parameters=model.parameters()))
    losses = []
    for step in range(steps):
        ids, labels, mask = batch(seed=step % 2)
        loss = model(ids, labels=labels, attention_mask=mask)[0]
        loss.backward()
        optimizer.step()
        optimizer.clear_grad()
        losses.append(float(loss))
    states = {(name, role): (getattr(fp8.states, role).amax_history.numpy().copy(),
                             getattr(fp8.states, role).scale.numpy().copy())
              for name, fp8 in fast_llama.fp8_layers(model).items() for role in fp8.states.roles()}
    paddle_fastffn.revert_fast_ffn()
    return np.array(losses), states


@pytest.mark.parametrize("recompute", ["reentrant", "non_reentrant"])
def test_fp8_delayed_scaling_under_paddlenlp_recompute_is_training_without_it(recompute, monkeypatch):
    """The recompute replays each layer's forward in backward; its FP8 quantisations take the
    forward's scales and record nothing (fp8/recompute.py), so training with recompute is training
    without it: the same losses and the same amax histories and scales (each rolled once per step).
    Without the wrapper the histories roll twice per step and the runs differ (the check can fail)."""
    plain_losses, plain_states = _train_fp8_delayed(None)
    losses, states = _train_fp8_delayed(recompute)
    np.testing.assert_array_equal(losses, plain_losses)
    assert states.keys() == plain_states.keys() and states
    for key, (history, scale) in states.items():
        np.testing.assert_array_equal(history, plain_states[key][0], err_msg=f"{key} amax history")
        np.testing.assert_array_equal(scale, plain_states[key][1], err_msg=f"{key} scale")

    from paddle_fastffn.fp8 import recompute as fp8_recompute_module
    monkeypatch.setattr(fp8_recompute_module, "fp8_recompute", lambda recompute_fn: recompute_fn)
    _, unwrapped = _train_fp8_delayed(recompute)
    assert any(not np.array_equal(history, plain_states[key][0]) for key, (history, _) in unwrapped.items())


def test_fp8_lm_head_trains_close_to_fp32_and_runs_its_gemms_in_fp8():
    """fp8_lm_head=fp8: the fused loss's three GEMMs in FP8 (core/fp8/lm_head.py) under the Trainer's
    own forward; losses within the FP8 training budget of fp32, and not those of the bf16 head."""
    steps = 4
    paddle_fastffn.apply_fast_ffn_to_llama()
    fp32_losses = train_steps(tiny_model(seed=3, **FP8_SHAPES), steps)
    paddle_fastffn.revert_fast_ffn()
    paddle_fastffn.apply_fast_ffn_to_llama(**FP8_EMULATED)
    with fp8_heads_made() as made:
        bf16_head_losses = train_steps(tiny_model(seed=3, **FP8_SHAPES), steps)
    assert not made
    paddle_fastffn.revert_fast_ffn()
    paddle_fastffn.apply_fast_ffn_to_llama(**FP8_EMULATED, fp8_lm_head="fp8")
    with fp8_heads_made() as made:
        fp8_head_losses = train_steps(tiny_model(seed=3, **FP8_SHAPES), steps)
    assert made == [(True, True, "in_out")] * steps  # one FP8 head per step, both gradients
    np.testing.assert_allclose(fp8_head_losses, fp32_losses, rtol=FP8_TRAINING_LOSS_RTOL)
    assert not np.array_equal(fp8_head_losses, bf16_head_losses)
    assert fp8_head_losses[-1] < fp8_head_losses[0]


def test_fp8_lm_head_on_a_misaligned_vocabulary_warns_once_and_keeps_the_head_in_its_dtype(monkeypatch):
    from paddle_fastffn.ops._fallback import UnrequestedFallbackError

    paddle_fastffn.apply_fast_ffn_to_llama(**FP8_EMULATED, fp8_lm_head="fp8")
    model = tiny_model(seed=3, vocab_size=120, **FP8_SHAPES)
    ids, labels, mask = batch(vocab=120)
    with pytest.raises(UnrequestedFallbackError, match="vocabulary 120 is not a multiple of 16"):
        model(ids, labels=labels, attention_mask=mask)  # tests run strict: a fallback is an error
    monkeypatch.setenv("PADDLE_FASTFFN_STRICT", "0")
    with pytest.warns(RuntimeWarning, match="fp8_lm_head=fp8: hidden size 64 or vocabulary 120") as caught:
        model(ids, labels=labels, attention_mask=mask)
        model(ids, labels=labels, attention_mask=mask)
    assert sum("fp8_lm_head" in str(w.message) for w in caught) == 1


def test_fp8_lm_head_where_the_fused_loss_leaves_the_head_to_stock_says_so(monkeypatch):
    """A head the fused loss cannot read (here a subclass of LlamaLMHead, whose forward may differ)
    keeps stock's head and loss: with fp8_lm_head=fp8 asked for, that is a warning (an error in strict
    mode), not an info line alone."""
    from paddlenlp.transformers.llama.modeling import LlamaLMHead

    from paddle_fastffn.ops._fallback import UnrequestedFallbackError

    class CustomHead(LlamaLMHead):
        pass

    paddle_fastffn.apply_fast_ffn_to_llama(**FP8_EMULATED, fp8_lm_head="fp8")
    model = tiny_model(seed=3, **FP8_SHAPES)
    model.lm_head = CustomHead(model.config)
    ids, labels, mask = batch()
    with pytest.raises(UnrequestedFallbackError, match="fp8_lm_head=fp8: the LM head is CustomHead"):
        model(ids, labels=labels, attention_mask=mask)
    monkeypatch.setenv("PADDLE_FASTFFN_STRICT", "0")
    with pytest.warns(RuntimeWarning, match="fp8_lm_head=fp8: the LM head is CustomHead.*stay stock"):
        loss = model(ids, labels=labels, attention_mask=mask)[0]
    assert np.isfinite(float(loss))
