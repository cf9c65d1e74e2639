"""The full-depth benchmark's plan (benchmarks/full_depth.py): LLaMA-2-7B's parameter counts, the
FLOP conventions, the persistent memory, the contenders and missing peers, and the out-of-memory
report. Pure logic, no torch; one test checks the FLOP count against bench_step's where torch is
installed (the GPU machine)."""

import importlib.util

import pytest

from benchmarks import full_depth as plan
from benchmarks.report import full_depth_section

SHAPE = plan.LLAMA2_7B
OOM_MESSAGE = ("CUDA out of memory. Tried to allocate 1.95 GiB. GPU 0 has a total capacity of 139.81 GiB of which "
               "1.02 GiB is free. Including non-PyTorch memory, this process has 138.78 GiB memory in use. Of the "
               "allocated memory 135.12 GiB is allocated by PyTorch, and 2.10 GiB is reserved by PyTorch but "
               "unallocated.")


def test_llama2_7b_parameter_counts():
    # Meta's LLaMA-2-7B: 6,738,415,616 parameters (untied 32000 x 4096 embedding and head)
    assert plan.parameter_count(**SHAPE) == 6_738_415_616
    # rank 8 on seven projections: r x (in + out) each; q/k/v/o 4 x 8 x 8192, gate/up 2 x 8 x 15104,
    # down 8 x 15104, per layer 262144 + 362496 = 624640
    assert plan.lora_parameter_count(**SHAPE) == 32 * 624_640


def test_nemo_model_flops_count_attention_in_full():
    """NeMo's tables' convention: model_flops plus the causal half it leaves out (12 instead of 6 x
    layers x seq x hidden a token); LLaMA-2-7B at 4096 tokens: 4096^2 x 32 x (12 + 12 + 18 x 11008 /
    4096 + 12 + 6 x 32000 / (32 x 4096)) = 46.08 GFLOP a token; Llama-3-8B's grouped KV heads count
    12 x 8 / 32 for k and v."""
    for shape in (plan.LLAMA2_7B, plan.LLAMA3_8B):
        extra = 6 * shape["layers"] * shape["batch"] * shape["seq"] ** 2 * shape["hidden"]
        assert plan.nemo_model_flops(**shape) == pytest.approx(plan.model_flops(**shape) + extra, rel=1e-12)
    per_token = plan.nemo_model_flops(**SHAPE) / (SHAPE["batch"] * SHAPE["seq"])
    assert per_token == pytest.approx(4096**2 * 32 * (12 + 12 + 18 * 11008 / 4096 + 12 + 6 * 32000 / (32 * 4096)))
    assert per_token == pytest.approx(46.084e9, rel=1e-4)


def test_model_flops_are_six_n_t_plus_causal_attention():
    tokens = SHAPE["batch"] * SHAPE["seq"]
    gemm_weights = plan.parameter_count(**SHAPE) - SHAPE["vocab"] * SHAPE["hidden"] - (2 * 32 + 1) * SHAPE["hidden"]
    attention = 6 * 32 * 4096 * 4096 * 4096
    assert plan.model_flops(**SHAPE) == 6 * gemm_weights * tokens + attention
    # 6 x 6.607e9 GEMM weights x 4096 tokens = 1.624e14, attention 6 x 32 x 4096^3 = 1.319e13
    assert plan.model_flops(**SHAPE) == pytest.approx(1.7557e14, rel=1e-4)


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="bench_step imports torch (the GPU machine)")
def test_model_flops_follow_bench_steps_convention():
    from benchmarks.gpu.bench_step import step_flops

    for shape in (SHAPE, {**SHAPE, "layers": 8, "batch": 4, "seq": 2048}, {**SHAPE, "kv_heads": 8}):
        assert plan.model_flops(**shape) == step_flops(**shape)


def test_lora_executed_flops_drop_the_frozen_weight_gradients():
    tokens = SHAPE["batch"] * SHAPE["seq"]
    full = plan.model_flops(**SHAPE)
    attention = 6 * 32 * 4096 ** 3
    frozen_gemm = (full - attention) / 6 / tokens
    expected = 4 * frozen_gemm * tokens + attention + 6 * plan.lora_parameter_count(**SHAPE) * tokens
    assert plan.lora_executed_flops(**SHAPE) == pytest.approx(expected, rel=1e-12)
    assert 0.6 < plan.lora_executed_flops(**SHAPE) / full < 0.75


def test_persistent_state_of_each_workload():
    n, n_lora = plan.parameter_count(**SHAPE), plan.lora_parameter_count(**SHAPE)
    full = plan.persistent_state_bytes("full", **SHAPE)
    assert full["total"] == 16 * n  # bf16 weights and grads, fp32 master, two fp32 moments
    assert full["total"] / 2**30 == pytest.approx(100.4, abs=0.1)
    lora = plan.persistent_state_bytes("lora", **SHAPE)
    assert lora["total"] == 2 * n + 16 * n_lora and lora["gradients_bf16"] == 2 * n_lora


def test_workloads_and_their_contenders():
    assert plan.workloads_from("lora,full") == ["lora", "full"]
    assert plan.workloads_from(" full ") == ["full"]
    for bad in ("", "lora,qlora", ","):
        with pytest.raises(ValueError, match="workloads"):
            plan.workloads_from(bad)
    ours = ("ours", "ours_fp8_delayed", "ours_fp8_current")
    assert plan.WORKLOADS["lora"] == ours + ("hf_liger_peft",)
    assert plan.WORKLOADS["full"] == ours + ("hf_liger",)
    assert plan.contenders("lora", packed=False) == plan.WORKLOADS["lora"]
    assert plan.contenders("lora", packed=True) == ours + ("hf_liger_peft_padding_free", "hf_liger_peft_padded")
    assert plan.contenders("full", packed=True) == ours + ("hf_liger_padding_free", "hf_liger_padded")
    assert plan.data_from("gsm8k, uniform") == ["gsm8k", "uniform"]
    for bad in ("", "alpaca", "gsm8k,,x"):
        with pytest.raises(ValueError, match="data must be"):
            plan.data_from(bad)
    # --contenders: any workload's contender on any of the data; a name that is none is refused by name
    assert plan.contenders_from("ours_fp8_delayed, hf_liger", ["full"], ["uniform"]) == ["ours_fp8_delayed", "hf_liger"]
    assert plan.contenders_from("hf_liger_padded", ["full"], ["uniform", "gsm8k"]) == ["hf_liger_padded"]
    with pytest.raises(ValueError, match=r"--contenders: \['hf_liger_padded'\] are not contenders of full on uniform"):
        plan.contenders_from("ours,hf_liger_padded", ["full"], ["uniform"])
    with pytest.raises(ValueError, match="--contenders"):
        plan.contenders_from(" , ", ["full"], ["uniform"])


def test_an_accumulated_step_counts_every_pass():
    for workload in ("lora", "full"):
        one = plan.step_work(workload, SHAPE, 4096, 4095)
        assert one == {"tokens": 4096, "labelled_tokens": 4095, "model_flops": plan.model_flops(**SHAPE),
                       "executed_flops": (plan.lora_executed_flops(**SHAPE) if workload == "lora"
                                          else plan.model_flops(**SHAPE)),
                       "nemo_model_flops": plan.nemo_model_flops(**SHAPE)}
        assert plan.step_work(workload, SHAPE, 4096, 4095, accumulation=4) == {k: 4 * v for k, v in one.items()}
    packed = plan.step_work("full", SHAPE, 100, 60, segment_lengths=[60, 40], accumulation=3)
    assert packed == {"tokens": 300, "labelled_tokens": 180,
                      "model_flops": 3 * plan.packed_model_flops([60, 40], **SHAPE), "executed_flops": None,
                      "nemo_model_flops": None}


def test_packed_model_flops_count_attention_within_each_example():
    one_row = plan.model_flops(**SHAPE)
    assert plan.packed_model_flops([SHAPE["seq"]], **SHAPE) == one_row  # one example filling the row
    halves = plan.packed_model_flops([SHAPE["seq"] // 2] * 2, **SHAPE)
    attention_saved = 6 * SHAPE["layers"] * (SHAPE["seq"] ** 2 // 2) * SHAPE["hidden"]
    assert one_row - halves == attention_saved  # GEMM work unchanged, attention halved


def test_a_workload_that_cannot_hold_its_state_does_not_fit():
    h100, h200 = 79.19 * 2**30, 139.81 * 2**30
    full = plan.fits("full", h100, **SHAPE)
    assert not full["fits"] and full["short_by_bytes"] == full["persistent_state_bytes"] - int(h100)
    assert plan.fits("full", h200, **SHAPE)["fits"] and plan.fits("lora", h100, **SHAPE)["fits"]


def test_missing_peer_packages_are_named_per_contender():
    present = {"transformers", "liger_kernel", "yaml", "tqdm", "safetensors", "huggingface_hub", "packaging", "numpy"}
    missing = plan.missing_packages(["lora", "full"], present.__contains__)
    assert missing == {name: ["peft", "accelerate", "psutil"]
                       for name in ("hf_liger_peft", "hf_liger_peft_padding_free", "hf_liger_peft_padded")}
    assert plan.missing_packages(["full"], present.__contains__) == {}
    assert plan.missing_packages(["lora"], lambda name: True) == {}


def test_oom_report_says_by_how_much():
    row = plan.oom_report(OOM_MESSAGE, "step", allocated_bytes=135 * 2**30, peak_bytes=137 * 2**30)
    assert row["oom"] and row["phase"] == "step"
    assert row["requested_bytes"] == round(1.95 * 2**30) and row["free_bytes"] == round(1.02 * 2**30)
    assert row["capacity_bytes"] == round(139.81 * 2**30)
    assert row["short_by_bytes"] == row["requested_bytes"] - row["free_bytes"]
    assert plan.describe_oom(row) == ("OOM in step: asked 1.95 GiB, 1.02 GiB free (short by at least 0.93 GiB) "
                                      "of 139.81 GiB")
    assert row["message"].startswith("CUDA out of memory.")


def test_oom_report_of_an_unusual_message_keeps_what_it_has():
    row = plan.oom_report("CUDA out of memory. Tried to allocate 20.00 MiB", "build")
    assert row["requested_bytes"] == 20 * 2**20 and row["free_bytes"] is None and row["short_by_bytes"] is None
    assert plan.describe_oom(row) == "OOM in build: asked 0.02 GiB, ? free"


def timing(median, spread=1.0):
    return {"p50_ms": median, "p20_ms": median - spread / 2, "p80_ms": median + spread / 2, "spread_ms": spread,
            "repeats": 3}


def test_report_section_renders_rows_ooms_and_missing_peers():
    def row(median, peak_gib, **extra):
        return {**timing(median), "step": timing(median), "forward_backward": timing(median * 0.8),
                "optimizer": timing(median * 0.2), "tokens_per_s": 4096 / (median * 1e-3), "model_tflops": 500.0,
                "executed_tflops": 350.0, "peak_bytes": peak_gib * 2**30, "layer_recompute": False,
                "first_losses": [10.4], **extra}
    oom = plan.oom_report(OOM_MESSAGE, "step")
    run = {"environment": {"date": "2026-12-05", "device": "NVIDIA H200", "torch": "2.11"},
           "command": "python3 -m benchmarks.gpu.bench_full_depth --out x.json",
           "shape": {**SHAPE, "tokens": 4096, "parameters": plan.parameter_count(**SHAPE),
                     "lora_parameters": plan.lora_parameter_count(**SHAPE)},
           "conventions": {"model_tflops": "6NT", "executed_tflops": "lora work", "timing": "round-robin"},
           "workloads": {
               "lora": {"contenders": {"ours": row(300.0, 30.0), "ours_fp8_delayed": row(250.0, 40.0),
                                       "hf_liger_peft": {"error": "not run: cannot be imported here (missing peft)"}},
                        "first_step_losses": {"ours": 10.4, "ours_fp8_delayed": 10.41},
                        "first_step_loss_max_relative_difference": 1e-3},
               "full": {"contenders": {"ours": row(400.0, 120.0, nemo_model_tflops=540.0),
                                       "ours_fp8_delayed": {**oom, "rounds": []},
                                       "hf_liger": row(440.0, 125.0, layer_recompute=True,
                                                       recompute_because=plan.describe_oom(oom))}},
               "full:gsm8k": {"contenders": {"ours": {"does_not_fit": True,
                                                      **plan.fits("full", 79.18 * 2**30, **SHAPE)}}}}}
    out = []
    full_depth_section(out, run)
    text = "\n".join(out)
    assert "missing peft" in text
    assert "OOM in step: asked 1.95 GiB, 1.02 GiB free (short by at least 0.93 GiB)" in text
    assert "hf_liger: 1.100x" in text  # ours 400 ms against hf_liger's 440 ms
    assert "full recompute per layer" in text
    assert "| 500 (NeMo's count: 540) |" in text and text.count("NeMo's count") == 1  # uniform rows quote it
    assert "--fp8-lm-head" not in text
    fp8_head = []
    full_depth_section(fp8_head, {**run, "fp8_lm_head": "fp8"})
    assert "LM head + loss run in FP8 too (`--fp8-lm-head fp8`)" in "\n".join(fp8_head)
    assert "--accumulation" not in text
    accumulated = []
    full_depth_section(accumulated, {**run, "accumulation": 4})
    assert "A step is 4 forward+backward passes over the step's data (`--accumulation`" in "\n".join(accumulated)
    assert "120.00" in text and "125.00" in text
    # a workload no contender fits is one line rather than a table of identical rows
    assert "full:gsm8k: no contender fits (ours): state 100.41 GiB > 79.18 GiB (short by 21.23 GiB)." in text
