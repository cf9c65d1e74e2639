"""What every CPU smoke test of a GPU benchmark section does with a contender: run one step and
check its loss, or, for a contender in NOT_ON_CPU, check that the step fails for the reason the table
gives (construction is never excused: it runs before the step, outside the expectation)."""

from __future__ import annotations

import math
import re

import torch

# A Triton kernel (Liger) raises this on a machine without a GPU driver.
TRITON = r"active drivers"

# (section, contender) -> (pattern the error must match, why the step cannot run on the CPU).
NOT_ON_CPU = {
    **{(section, contender): (TRITON, "Liger's kernels are Triton, which needs a GPU driver")
       for section, contender in (
           ("step", "liger_flce"), ("step", "hf_liger"), ("step", "hf_liger_amp"),
           ("decoder", "hf_liger"), ("profile", "hf_liger"),
           ("full_depth", "hf_liger"), ("full_depth", "hf_liger_peft"),
           ("full_depth", "hf_liger_padding_free"), ("full_depth", "hf_liger_padded"),
           ("full_depth", "hf_liger_peft_padding_free"), ("full_depth", "hf_liger_peft_padded"),
           ("full_depth", "hf_liger_bf16_adamw"), ("full_depth", "hf_liger_adamw8bit"),
           ("packed_sft", "hf_liger_padding_free"), ("packed_sft", "hf_liger_padded"),
           ("kernels", "liger"), ("kernels", "liger_packed"), ("rope_sweep", "liger"), ("rms_sweep", "liger"))},
    **{("step", contender): (r"GEMM tuning times cuBLASLt's candidate algorithms",
                             "GEMM tuning chooses among cuBLASLt's algorithms, which the CPU GEMM does not have")
       for contender in ("ours_fp8_delayed_tuned", "ours_fp8_delayed_fp8_head_cached_tuned")},
    ("fp8", "torchao_rowwise"): (r"_scaled_mm only supports per-tensor scaling for CPU",
                                 "torchao's rowwise recipe needs the GPU's row-wise scaled_mm"),
    ("optimizer", "paddle"): (r"NVIDIA driver|nvcc|CUDA", "the stock-Paddle AdamW port is a CUDA source (paddle_adamw.cu)"),
}


def finite_loss(section: str, contender: str, loss) -> float:
    value = float(loss.detach().float().item()) if isinstance(loss, torch.Tensor) else float(loss)
    assert math.isfinite(value), f"{section}/{contender}: loss {value}"
    return value


def run_step(section: str, contender: str, step, failures: list) -> None:
    """step() runs one step (and checks its own result); a failure is appended as
    'section/contender: error', or, for a NOT_ON_CPU entry, a step that does not fail as the table
    says."""
    expected = NOT_ON_CPU.get((section, contender))
    try:
        step()
    except Exception as error:  # noqa: BLE001
        text = f"{type(error).__name__}: {error}"
        if expected is None:
            failures.append(f"{section}/{contender}: {text[:1500]}")
        elif not re.search(expected[0], text):
            failures.append(f"{section}/{contender}: expected to fail on CPU because {expected[1]} "
                            f"(/{expected[0]}/), failed with {text[:1500]}")
        return
    if expected is not None:
        failures.append(f"{section}/{contender}: ran on CPU, but NOT_ON_CPU says {expected[1]}: drop the entry")


def check(section: str, names, failures: list) -> None:
    """Fails with every contender's failure; NOT_ON_CPU's entries of this section must all be
    contenders it has (a renamed contender leaves a stale entry)."""
    stale = [c for s, c in NOT_ON_CPU if s == section and c not in set(names)]
    assert not stale, f"{section}: NOT_ON_CPU names contenders the section no longer has: {stale}"
    assert not failures, "\n".join(failures)
