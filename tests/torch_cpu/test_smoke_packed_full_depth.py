"""CPU smoke of the full_depth (the user's job) and packed_sft sections: every contender built as the
section builds it and one training step, at tiny shapes, on packed data made by the product's own
collation (sft_packed_steps.build_step over a small length profile written here in the data file
format, since the real profiles live in shared/) and on uniform rows. The sections' device-bound
helpers (bench_step.new_hf_model, bench_packed_sft.on_device) are pointed at the CPU."""

from __future__ import annotations

import argparse
import functools
import json

import numpy as np
import pytest
import torch

from benchmarks import full_depth as plan
from benchmarks import sft_lengths
from benchmarks.gpu import bench_step
from smoke import check, finite_loss, run_step
from test_smoke_sections import SHAPE, model_steps

ROW_TOKENS = 32


@pytest.fixture
def tiny_profiles(tmp_path, monkeypatch):
    """Both profile names backed by small [prompt, response] length files in the data format."""
    rng = np.random.default_rng(0)
    for name, file in sft_lengths.PROFILES.items():
        pairs = np.stack([rng.integers(2, 9, 40), rng.integers(2, 12, 40)], 1).tolist()
        (tmp_path / file).write_text(json.dumps({"name": name, "count": len(pairs), "lengths": pairs,
                                                 "source": {"note": "CPU smoke: random lengths"}}))
    monkeypatch.setattr(sft_lengths, "DATA_DIR", tmp_path)


def full_depth_args(**overrides):
    return argparse.Namespace(**{"rows_per_step": 2, "padded_batch_size": 3, "seed": 0, "src_length": 8,
                                 **overrides})


@pytest.mark.parametrize("data", plan.DATA)
@pytest.mark.parametrize("workload", sorted(plan.WORKLOADS))
def test_full_depth_section(monkeypatch, tiny_profiles, workload, data):
    full_depth_section(monkeypatch, workload, data, "bf16")


@pytest.mark.parametrize("workload", ["lora", "full"])
def test_full_depth_section_with_the_fp8_lm_head(monkeypatch, tiny_profiles, workload):
    """--fp8-lm-head fp8: the FP8 contenders' LM head in FP8 too, on a packed step (labelled rows that
    are not a multiple of 16)."""
    full_depth_section(monkeypatch, workload, plan.PACKED_DATA[0], "fp8")


def full_depth_section(monkeypatch, workload, data, fp8_lm_head):
    from benchmarks.gpu import bench_full_depth

    monkeypatch.setattr(bench_full_depth, "new_hf_model", functools.partial(bench_step.new_hf_model, device="cpu"))
    shape = dict(SHAPE, batch=1, seq=ROW_TOKENS)
    step_data = bench_full_depth.StepData(data, shape, full_depth_args(), device="cpu")
    assert step_data.labelled_tokens > 0 and step_data.packed_data == (data != "uniform")
    table = bench_full_depth.builders(workload, shape, step_data, "llama2_7b", fp8_lm_head)
    assert tuple(table) == plan.contenders(workload, step_data.packed_data)
    failures = []
    for name, (build, context) in table.items():
        with context():
            try:
                model, forward, *optimizer = build(False)
            except Exception as error:  # noqa: BLE001
                failures.append(f"full_depth/{name} ({workload}, {data}): construction failed: "
                                f"{type(error).__name__}: {error}")
                continue

            def step(model=model, forward=forward, name=name, make=(optimizer or [bench_step.fused_master_adamw])[0]):
                finite_loss("full_depth", name, bench_step.training_step(forward, model, make(model.parameters()))())
                memory = bench_full_depth.memory_by_category(model, None, make)
                fp8, ours = "fp8" in name, name.startswith("ours")
                expected = {"frozen_weights_fp8": ours and fp8 and workload == "lora",
                            # trained weights' FP8 copies: quantised per use (the recipe's default), none held
                            "fp8_weight_copies": False, "gradients": True,
                            "optimizer_masters": make.__name__ in ("fused_master_adamw", "int8_compensated_adamw")}
                wrong = [f"{k}={memory[k]}" for k, nonzero in expected.items() if (memory[k] > 0) != nonzero]
                assert not wrong, f"memory_by_category: expected {expected}, got {wrong}"
                if ours and fp8:  # the FP8 contenders' head follows --fp8-lm-head
                    assert (model.lm_head_fp8 is not None) == (fp8_lm_head == "fp8"), model.lm_head_fp8
            run_step("full_depth", name, step, failures)
    check("full_depth", [c for w in plan.WORKLOADS for p in (True, False) for c in plan.contenders(w, p)], failures)


def test_packed_sft_section(monkeypatch, tiny_profiles):
    from benchmarks.gpu import bench_packed_sft
    from benchmarks.sft_packed_steps import build_step

    monkeypatch.setattr(bench_packed_sft, "MODEL", dict(SHAPE, seq=ROW_TOKENS))
    monkeypatch.setattr(bench_packed_sft, "new_hf_model", functools.partial(bench_step.new_hf_model, device="cpu"))
    monkeypatch.setattr(bench_packed_sft, "on_device", functools.partial(bench_packed_sft.on_device, device="cpu"))
    step = build_step("gsm8k", rows_per_step=2, row_tokens=ROW_TOKENS, padded_batch_size=3,
                      vocab_size=SHAPE["vocab"], src_length=8)
    torch.manual_seed(0)
    base = bench_step.new_hf_model(bench_step.hf_config(bench_packed_sft.MODEL), "cpu")
    contenders = bench_packed_sft.contenders(base, step)
    failures = []
    model_steps("packed_sft", contenders, failures, liger_contenders=[n for n in contenders if n.startswith("hf_liger")])
    check("packed_sft", bench_packed_sft.CONTENDERS, failures)


def test_full_depth_profile_mode(monkeypatch, tiny_profiles):
    """bench_full_depth --profile: each named contender built as the timed rows build it and handed,
    with its own optimizer, to profile_step.profile_training (here one plain training step: the
    profiler's CUDA timeline needs a GPU); an unknown contender is refused by name."""
    from benchmarks.gpu import bench_full_depth, profile_step

    monkeypatch.setattr(bench_full_depth, "new_hf_model", functools.partial(bench_step.new_hf_model, device="cpu"))
    profiled = {}

    def one_step(forward, model, make_optimizer, steps, accumulation):
        assert accumulation == 2  # --accumulation reaches the profiled steps
        step = bench_step.training_step(forward, model, make_optimizer(model.parameters()), accumulation)
        host = profile_step.host_python_profile(step, steps=1)  # the host's profile runs on the CPU as it is
        assert host["python_calls_per_step"] > 0 and host["by_own_time"], host
        assert any("fp8/linear.py" in row["function"] or "llama.py" in row["function"]
                   for row in host["by_cumulative_time"]), [row["function"] for row in host["by_cumulative_time"]]
        profiled[make_optimizer.__name__] = finite_loss("full_depth", "profile", step())
        return {"gpu_only": {"kernel_ms_by_category": {}}, "host_python": host}

    monkeypatch.setattr(profile_step, "profile_training", one_step)
    shape = dict(SHAPE, batch=1, seq=ROW_TOKENS)
    data = bench_full_depth.StepData("gsm8k", shape, full_depth_args(), device="cpu")
    report = {}
    bench_full_depth.profile_contenders(["ours_int8_compensated", "ours_bf16_adamw"], "full_low_memory", shape,
                                        data, "llama2_7b", report, lambda: None, lambda line: None, accumulation=2)
    assert set(report["profiles"]) == {"workload", "data", "ours_int8_compensated", "ours_bf16_adamw"}
    assert set(profiled) == {"int8_compensated_adamw", "fused_torch_adamw"}
    with pytest.raises(SystemExit, match="'nobody' is not a full_low_memory contender"):
        bench_full_depth.profile_contenders(["nobody"], "full_low_memory", shape, data, "llama2_7b", {}, lambda: None,
                                            lambda line: None)


@pytest.mark.parametrize("contender", ["ours", "ours_fp8_delayed"])
def test_accumulated_step_trains_the_mean_of_its_micro_batches(monkeypatch, contender):
    """--accumulation: a step of two micro-batches over the same data leaves the gradients of one
    (the loss divided by their count, as the Trainers divide it), not twice them; bf16 and FP8 (Liger's
    peers need a GPU; the padded one, whose forward runs backwards itself, has its own test below)."""
    from benchmarks.gpu import bench_full_depth

    monkeypatch.setattr(bench_full_depth, "new_hf_model", functools.partial(bench_step.new_hf_model, device="cpu"))
    shape = dict(SHAPE, batch=1, seq=ROW_TOKENS)
    data = bench_full_depth.StepData("uniform", shape, full_depth_args(), device="cpu")
    build, context = bench_full_depth.builders("full", shape, data, "llama2_7b")[contender]
    gradients = {}
    for accumulation in (1, 2):
        with context():
            model, forward = build(False)
            loss = bench_step.accumulated_backward(forward, accumulation)
        assert torch.isfinite(loss), loss
        gradients[accumulation] = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}
    assert gradients[1] and set(gradients[1]) == set(gradients[2])
    # FP8 delayed scaling: the second micro-batch quantises with the first one's amax, so its
    # gradients are not bit for bit the first's; twice the gradients would be 1.0 away
    bound = 0.1 if "fp8" in contender else 1e-2
    for name, one in gradients[1].items():
        distance = float((gradients[2][name] - one).norm() / one.norm().clamp_min(1e-30))
        assert distance <= bound, f"{contender} {name}: relative distance {distance:.3g} > {bound}"
    with pytest.raises(ValueError, match="accumulation: expected micro-batches per optimizer step >= 1, got 0"):
        bench_step.accumulated_backward(forward, 0)



def test_accumulated_padded_peer_weighs_every_micro_batch_alike(monkeypatch, tiny_profiles):
    """The padded peer's forward runs the backward of every padded micro-batch but the last inside
    (accumulating_forward): under --accumulation those are divided by the count too, so two passes
    over the step leave the gradients of one. Hugging Face's model without Liger's patch (Liger
    needs a GPU): the accumulation is the bench's, not the library's."""
    from benchmarks.gpu import bench_full_depth
    from benchmarks.gpu.bench_packed_sft import accumulating_forward

    shape = dict(SHAPE, batch=1, seq=ROW_TOKENS)
    data = bench_full_depth.StepData("gsm8k", shape, full_depth_args(), device="cpu")
    assert len(data.padded) > 1  # micro-batches whose backward runs inside the forward
    gradients = {}
    for accumulation in (1, 2):
        torch.manual_seed(0)
        model = bench_step.new_hf_model(bench_step.hf_config(shape), "cpu")
        bench_step.accumulated_backward(accumulating_forward(model, data.padded, data.labelled_tokens, accumulation),
                                        accumulation)
        gradients[accumulation] = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}
    for name, one in gradients[1].items():
        distance = float((gradients[2][name] - one).norm() / one.norm().clamp_min(1e-30))
        assert distance <= 1e-2, f"{name}: relative distance {distance:.3g}"


def test_measure_workload_times_accumulated_steps_of_the_named_contenders(monkeypatch):
    """measure_workload as the GPU run calls it, on the CPU: --contenders keeps the named rows only,
    --accumulation reaches every timed step (each one the real training step of that many passes)
    and the rows' rates count every pass. run_once, the one CUDA-timed call, is replaced by the same
    training step on the CPU with a fixed time; the card's memory is a stand-in's."""
    import types

    from benchmarks.gpu import bench_full_depth

    monkeypatch.setattr(bench_full_depth, "new_hf_model", functools.partial(bench_step.new_hf_model, device="cpu"))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: types.SimpleNamespace(total_memory=80 << 30))
    accumulations = []

    def cpu_run_once(build, context, recompute, steps, warmup, accumulation=1):
        accumulations.append(accumulation)
        with context():
            model, forward = build(recompute)
            step = bench_step.training_step(forward, model, bench_step.fused_master_adamw(model.parameters()),
                                            accumulation)
            loss = finite_loss("full_depth", "measure_workload", step())
        return {"step_ms": 100.0, "forward_backward_ms": 90.0, "optimizer_ms": 10.0, "first_losses": [loss],
                "peak_bytes": 1}

    monkeypatch.setattr(bench_full_depth, "run_once", cpu_run_once)
    shape = dict(SHAPE, batch=1, seq=ROW_TOKENS)
    data = bench_full_depth.StepData("uniform", shape, full_depth_args(), device="cpu")
    result = bench_full_depth.measure_workload("full", shape, data, "llama2_7b", 3, 3, 1, lambda progress: None,
                                               float("inf"), lambda line: None, accumulation=3,
                                               only=["ours_fp8_delayed", "ours"])
    assert set(result["contenders"]) == {"ours", "ours_fp8_delayed"} and accumulations == [3] * 6, accumulations
    work = plan.step_work("full", shape, data.tokens, data.labelled_tokens, None, 3)
    assert result["accumulation"] == 3 and result["model_flops_per_step"] == work["model_flops"]
    for name, row in result["contenders"].items():
        assert row["tokens_per_s"] == pytest.approx(3 * data.tokens / 0.1), name
        assert row["model_tflops"] == pytest.approx(work["model_flops"] / 0.1 / 1e12), name
    emptied = bench_full_depth.measure_workload("full", shape, data, "llama2_7b", 3, 3, 1, lambda progress: None,
                                                float("inf"), lambda line: None, only=["hf_liger_padded"])
    assert "contenders" not in emptied and "none of --contenders" in emptied["error"]
