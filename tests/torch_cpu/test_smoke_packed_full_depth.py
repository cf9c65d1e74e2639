"""CPU smoke of the full_depth and packed_sft sections, against their current public functions
(bench_full_depth.builders, bench_packed_sft.contenders / on_device / hf_model / MODEL,
bench_step.new_hf_model as those modules import it): kept apart from test_smoke_sections.py because
those sections are being rewritten. Both modules build on "cuda" without a device argument, so the
tests point their module-level new_hf_model / on_device / MODEL at the CPU and tiny shapes."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from benchmarks import full_depth as plan
from benchmarks.gpu import bench_step
from smoke import check, finite_loss, run_step
from test_smoke_sections import SHAPE, model_steps


@pytest.mark.parametrize("workload", sorted(plan.WORKLOADS))
def test_full_depth_section(monkeypatch, workload):
    from benchmarks.gpu import bench_full_depth

    monkeypatch.setattr(bench_full_depth, "new_hf_model", functools.partial(bench_step.new_hf_model, device="cpu"))
    ids, labels = bench_full_depth.random_batch(SHAPE, device="cpu")
    table = bench_full_depth.builders(workload, SHAPE, ids, labels)
    failures = []
    for name, (build, context) in table.items():
        with context():
            try:
                model, forward = build(False)
            except Exception as error:  # noqa: BLE001
                failures.append(f"full_depth/{name} ({workload}): construction failed: {type(error).__name__}: {error}")
                continue

            def step(model=model, forward=forward, name=name):
                optimizer = bench_step.fused_master_adamw(model.parameters())
                finite_loss("full_depth", name, bench_step.training_step(forward, model, optimizer)())
            run_step("full_depth", name, step, failures)
    check("full_depth", [c for w in plan.WORKLOADS.values() for c in w], failures)


def test_packed_sft_section(monkeypatch):
    from benchmarks.gpu import bench_packed_sft
    from benchmarks.sft_packed_steps import StepBatches  # noqa: F401  (the step's type, built below by hand)

    monkeypatch.setattr(bench_packed_sft, "MODEL", dict(SHAPE, seq=32))
    monkeypatch.setattr(bench_packed_sft, "new_hf_model", functools.partial(bench_step.new_hf_model, device="cpu"))
    monkeypatch.setattr(bench_packed_sft, "on_device", lambda batch: {
        k: torch.as_tensor(v) if k in ("input_ids", "labels", "position_ids", "attention_mask") else v
        for k, v in batch.items()})
    rng = np.random.default_rng(0)
    lengths = (5, 11, 9, 7)  # four examples: two packed rows of 16, one flattened row, two padded micro-batches
    ids = [rng.integers(0, SHAPE["vocab"], n) for n in lengths]
    positions = np.concatenate([np.arange(n) for n in lengths])
    flat_ids = np.concatenate(ids)
    labels = np.concatenate([np.append(x[1:], -100) for x in ids])
    packed = {"input_ids": flat_ids.reshape(2, 16), "labels": labels.reshape(2, 16),
              "position_ids": positions.reshape(2, 16), "cu_seqlens": np.cumsum((0,) + lengths).astype(np.int32)}
    flattened = {"input_ids": flat_ids[None], "labels": labels[None], "position_ids": positions[None]}

    def padded(rows):
        width = max(len(ids[i]) for i in rows)
        pad = lambda a, v: np.concatenate([a, np.full(width - len(a), v)])  # noqa: E731
        return {"input_ids": np.stack([pad(ids[i], 0) for i in rows]),
                "labels": np.stack([pad(np.append(ids[i][1:], -100), -100) for i in rows]),
                "attention_mask": np.stack([pad(np.ones(len(ids[i]), np.int64), 0) for i in rows])}
    step = type("Step", (), {"packed": packed, "flattened": flattened, "padded": [padded((0, 1)), padded((2, 3))],
                             "labelled_tokens": int((labels != -100).sum())})()
    torch.manual_seed(0)
    base = bench_step.new_hf_model(bench_step.hf_config(bench_packed_sft.MODEL), "cpu")
    contenders = bench_packed_sft.contenders(base, step)
    failures = []
    model_steps("packed_sft", contenders, failures, liger_contenders=[n for n in contenders if n.startswith("hf_liger")])
    check("packed_sft", bench_packed_sft.CONTENDERS, failures)
