"""benchmarks/step_floor.py: its byte model against the GPU benchmark's own byte counts, and its
floor against the committed measurements (a floor above a measured step would mean the model is wrong)."""

import json

from benchmarks import step_floor
from benchmarks.common import RESULTS_DIR


def test_op_bytes_match_the_kernel_benchmarks_byte_counts():
    bench = json.loads((RESULTS_DIR / "run15" / "gpu_bench.json").read_text())
    rows = {(r["op"], r["pass"]): r["bytes"] for r in bench["kernels"] if r["model"] == "7B" and r["impl"] == "ours"}
    # bench_gpu's 7B rows: 8192 tokens, hidden 4096, intermediate 11008, 32 heads, no GQA
    shape = {"tokens": 8192, "hidden": 4096, "inter": 11008, "heads": 32, "kv_heads": 32}
    expected = step_floor.op_bytes(shape)
    for op in ("fused_add_rms_norm", "rms_norm", "rotary", "swiglu"):
        assert expected[op] == rows[(op, "fwd+bwd")], op


def test_floor_lies_below_every_measured_step(tmp_path):
    out = step_floor.main(["--out", str(tmp_path / "step_floor.json")])
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 3
    for row in rows:
        floor = row["floor"]["total_ms"]
        assert 0 < floor < row["ours_forward_backward_ms"] and floor < row["hf_liger_forward_backward_ms"], row["config"]
