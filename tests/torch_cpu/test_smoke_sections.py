"""Every contender of every benchmarks/gpu section (run_on_h200.sh's list; packed_sft and full_depth
in test_smoke_packed_full_depth.py) built as its section builds it, at tiny shapes on the CPU, and
one step of each run through the composition (smoke.py: what cannot run on CPU, and why)."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from types import SimpleNamespace

import torch

from benchmarks.gpu import bench_fp8_ffn, bench_gpu, bench_optimizer, bench_step, convergence, profile_step
from benchmarks.gpu.bench_gpu import liger_patched
from paddle_fastffn.torch.build import REPO, definition
from smoke import check, finite_loss, run_step

# LLaMA-shaped and tiny: grouped-query attention, FP8-aligned widths (multiples of 16), 32 tokens.
SHAPE = dict(batch=2, seq=16, hidden=64, inter=96, heads=4, kv_heads=2, layers=2, vocab=128)
TOKENS = SHAPE["batch"] * SHAPE["seq"]


def hf_base():
    config = bench_step.hf_config(SHAPE)
    torch.manual_seed(0)
    return config, bench_step.new_hf_model(config, "cpu")


def model_steps(section, contenders, failures, liger_contenders=(), step_context=lambda name: contextlib.nullcontext()):
    """One training step (bench_step.training_step) of each build() -> (model, forward, make_optimizer),
    under step_context(name) as its section runs it."""
    for name, build in contenders.items():
        patch = liger_patched(fused_linear_cross_entropy=True) if name in liger_contenders else contextlib.nullcontext()
        with patch:
            try:
                model, forward, make_optimizer = build()
            except Exception as error:  # noqa: BLE001
                failures.append(f"{section}/{name}: construction failed: {type(error).__name__}: {error}")
                continue

            def step(model=model, forward=forward, make_optimizer=make_optimizer, name=name):
                with step_context(name):
                    loss = bench_step.training_step(forward, model, make_optimizer(model.parameters()))()
                finite_loss(section, name, loss)
            run_step(section, name, step, failures)
        torch._dynamo.reset()


def test_tests_section_collects():
    """tests: tests/benchmarks_logic collects in the GPU machine's Python (tests/gpu's conftest skips
    the whole folder without a CUDA device, before anything of it is imported)."""
    result = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                             "tests/benchmarks_logic"], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, f"tests: collection failed:\n{result.stdout[-3000:]}\n{result.stderr[-2000:]}"


def test_step_section():
    failures, names = [], []
    impls, *_ = bench_step.loss_contenders(SHAPE["vocab"], TOKENS, SHAPE["hidden"], liger=True, device="cpu")
    for name, (fn, inputs) in impls.items():
        names.append(name)
        run_step("step", name, lambda fn=fn, inputs=inputs, name=name: (
            finite_loss("step", name, fn(*inputs)), fn(*inputs).backward()), failures)
    config, base = hf_base()
    ids = torch.randint(0, SHAPE["vocab"], (SHAPE["batch"], SHAPE["seq"]))
    from paddle_fastffn.torch.llama import shift_labels

    contenders = bench_step.step_contenders(config, base, ids, shift_labels(ids), liger=True)
    names += list(contenders)
    model_steps("step", contenders, failures, liger_contenders=("hf_liger", "hf_liger_amp"),
                step_context=lambda name: bench_step.tuning_for(name, {}))
    check("step", names, failures)


def test_profile_section():
    failures = []
    config, base = hf_base()
    ids = torch.randint(0, SHAPE["vocab"], (SHAPE["batch"], SHAPE["seq"]))
    from paddle_fastffn.torch.llama import shift_labels

    contenders = profile_step.profile_contenders(config, base, ids, shift_labels(ids))
    model_steps("profile", contenders, failures, liger_contenders=("hf_liger",))
    check("profile", contenders, failures)


def test_optimizer_section():
    failures = []
    shapes = bench_optimizer.parameter_shapes(**SHAPE)
    grads = [(torch.randn(s) * 1e-3).to(torch.bfloat16) for s in shapes]
    contenders = [(name, clip) for name in bench_optimizer.OPTIMIZERS for clip in (False, True)]
    contenders += [(name, False) for name in bench_optimizer.LOW_MEMORY_OPTIMIZERS]
    for name, clip in contenders:
        try:
            params, _, step = bench_optimizer.make_contender(name, shapes, clip, grads)
        except Exception as error:  # noqa: BLE001
            failures.append(f"optimizer/{name}: construction failed: {type(error).__name__}: {error}")
            continue
        before = [p.detach().clone() for p in params]

        def run(params=params, step=step, before=before):
            step()
            assert any(not torch.equal(p, b) for p, b in zip(params, before)), "the step changed no parameter"
        run_step("optimizer", name, run, failures)
    check("optimizer", {**bench_optimizer.OPTIMIZERS, **bench_optimizer.LOW_MEMORY_OPTIMIZERS}, failures)


def test_decoder_section():
    failures = []
    shape = {k: SHAPE[k] for k in ("batch", "seq", "hidden", "inter", "heads", "kv_heads")}
    builders, contexts, x, dy = bench_gpu.decoder_contenders(shape, liger=True, device="cpu")
    for name, build in builders.items():
        with contexts.get(name, contextlib.nullcontext)():
            try:
                fn, params = build()
            except Exception as error:  # noqa: BLE001
                failures.append(f"decoder/{name}: construction failed: {type(error).__name__}: {error}")
                continue

            def run(fn=fn, params=params):
                out = fn(x)
                torch.autograd.backward((out,), (dy,))
                assert torch.isfinite(out.float()).all() and x.grad is not None, "non-finite output or no input gradient"
                x.grad = None
            run_step("decoder", name, run, failures)
        torch._dynamo.reset()
    check("decoder", builders, failures)


def test_kernels_section():
    failures, names = [], set()
    for op, pass_name, _, impls in bench_gpu.kernel_contenders(TOKENS, SHAPE["hidden"], SHAPE["inter"], SHAPE["heads"],
                                                               SHAPE["kv_heads"], liger=True, seq=SHAPE["seq"],
                                                               device="cpu"):
        for name, run in impls.items():
            names.add(name)
            run_step("kernels", name, run, failures)
        torch._dynamo.reset()
    check("kernels", names, failures)


def test_projections_section():
    from paddle_fastffn.torch.fp8 import c_api as fp8_c_api

    failures, names = [], set()
    for model, projections in bench_gpu.PROJECTIONS.items():
        for projection, parts in projections.items():
            tiny = tuple(max(16, p // 256) for p in parts)  # the same part structure, 1/256 the width
            fns, x, w, y = bench_gpu.projection_contenders(TOKENS, SHAPE["hidden"], tiny, fp8_c_api.kernels(),
                                                           device="cpu")
            for name, fn in fns.items():
                names.add(name)

                def run(fn=fn, fused=name != "split_torch"):  # split_torch writes its parts' own outputs
                    y.fill_(float("nan"))
                    fn()
                    if fused:
                        torch.testing.assert_close(y.float(), (x @ w.t()).float(), rtol=2e-2, atol=2e-2)
                run_step("projections", f"{name}", run, failures)
    check("projections", names, failures)


def test_rms_sweep_section():
    """ours (the build c_api._KERNELS holds) and Liger; the per-vectors builds are CUDA build
    variants (a template parameter of rms_norm.cu, no CPU counterpart), compiled by
    tests/build_checks where nvcc exists: here the knob must still be the one rms_norm.cu reads."""
    assert "FASTFFN_RMS_NORM_VECS_PER_THREAD" in (REPO / "csrc/kernels/cuda/rms_norm.cu").read_text(), \
        "rms_sweep/ours: rms_norm.cu no longer reads FASTFFN_RMS_NORM_VECS_PER_THREAD"
    failures = []
    for impl in ("ours", "liger"):
        for op, run, _ in bench_gpu.rms_sweep_contenders(TOKENS, SHAPE["hidden"], impl, device="cpu"):
            run_step("rms_sweep", impl, run, failures)
    check("rms_sweep", ("ours", "liger"), failures)


def test_rope_sweep_section():
    """rotary_contenders as rope_sweep builds them (eager=False); the heads-per-thread builds are CUDA
    build variants (build_definition.ROTARY_HEADS_PER_THREAD), compiled by tests/build_checks."""
    assert "FASTFFN_ROTARY_HEADS_PER_THREAD" in (REPO / "csrc/kernels/cuda/rotary.cu").read_text(), \
        "rope_sweep/ours: rotary.cu no longer reads FASTFFN_ROTARY_HEADS_PER_THREAD"
    assert 1 in definition.ROTARY_HEADS_PER_THREAD, "rope_sweep: the default build (1 head per thread) is gone"
    failures = []
    impls_fwd, impls_fb, _, _ = bench_gpu.rotary_contenders(TOKENS, SHAPE["hidden"], SHAPE["heads"], SHAPE["kv_heads"],
                                                            liger=True, eager=False, seq=SHAPE["seq"], device="cpu")
    for impls in (impls_fwd, impls_fb):
        for name, run in impls.items():
            run_step("rope_sweep", name, run, failures)
    check("rope_sweep", impls_fb, failures)


def test_fp8_section():
    failures, names = [], []
    functional, modules, others, x, w_gate_up, w_down, dy = bench_fp8_ffn.ffn_contenders(
        SHAPE["hidden"], SHAPE["inter"], TOKENS, device="cpu")
    reference = bench_fp8_ffn.eager_ffn(x.detach().float(), w_gate_up.detach().float(), w_down.detach().float())
    for name, (fn, inputs) in functional.items():
        names.append(name)

        def run(fn=fn, inputs=inputs):
            out = fn(*inputs)
            out.backward(dy)
            # FP8 (e4m3 forward) is within a few per cent of the fp32 FFN at these widths
            err = float((out.float() - reference).norm() / reference.norm())
            assert err < 0.1, f"relative error {err:.3f} against the fp32 FFN"
        run_step("fp8", name, run, failures)
    for name, build in modules.items():
        names.append(name)
        try:
            module = build()
        except Exception as error:  # noqa: BLE001
            failures.append(f"fp8/{name}: construction failed: {type(error).__name__}: {error}")
            continue
        run_step("fp8", name, bench_fp8_ffn.module_step(module, x, dy), failures)
        torch._dynamo.reset()
    for name, make in others.items():
        names.append(name)
        run_step("fp8", name, lambda make=make: make()(), failures)
    check("fp8", names, failures)


def test_fp8_quantization_kernels_section():
    """bench_fp8_ffn's quantisation table (--sections quantization): every kernel it times, and each
    current-scaling composite, called once at a tiny width on the CPU kernels."""
    failures = []
    kernels, scale_update, amax = bench_fp8_ffn.quantization_kernels(SHAPE["hidden"], SHAPE["inter"], TOKENS,
                                                                      device="cpu")
    for name, (fn, nbytes) in kernels.items():
        assert nbytes > 0, name
        run_step("fp8_quantization", name, fn, failures)
    composites = [row[0] for row in bench_fp8_ffn.CURRENT_SCALING_ROWS]
    for row in bench_fp8_ffn.CURRENT_SCALING_ROWS:
        run_step("fp8_quantization", f"{row[0]}_current_scaling",
                 bench_fp8_ffn.current_scaling(kernels, scale_update, amax, row), failures)
    assert float(amax) > 0, "the amax passes accumulate into the table's amax"
    check("fp8_quantization", [*kernels, *(f"{name}_current_scaling" for name in composites)], failures)


def test_convergence_section():
    """convergence.train for every precision and every optimizer state the section trains, a few steps of a
    tiny LLaMA."""
    failures = []
    model_config = dict(hidden_size=SHAPE["hidden"], intermediate_size=SHAPE["inter"],
                        num_attention_heads=SHAPE["heads"], num_key_value_heads=SHAPE["kv_heads"],
                        num_hidden_layers=SHAPE["layers"], vocab_size=SHAPE["vocab"], max_position_embeddings=64,
                        rms_norm_eps=1e-5, tie_word_embeddings=False)
    from transformers import LlamaConfig
    from transformers.models.llama import modeling_llama

    torch.manual_seed(0)
    state = modeling_llama.LlamaForCausalLM(LlamaConfig(**model_config)).state_dict()
    data = torch.randint(0, SHAPE["vocab"], (4096,))
    args = SimpleNamespace(lr=1e-3, batch=2, seq=16, steps=2, warmup=1, eval_every=2)
    runs = [(precision, "fp32_master") for precision in convergence.PRECISIONS]
    runs += [("bf16", name) for name in convergence.OPTIMIZERS if name != "fp32_master"]
    for precision, optimizer in runs:
        def run(precision=precision, optimizer=optimizer):
            result = convergence.train(precision, state, data, data[:1024], args, model_config=model_config,
                                       device="cpu", optimizer_name=optimizer)
            assert not result["nonfinite_steps"], result["train_loss"]
        run_step("convergence", f"{precision}+{optimizer}", run, failures)
    check("convergence", [f"{p}+{o}" for p, o in runs], failures)
