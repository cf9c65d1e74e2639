"""The fast path's one-line report (paddle_fastffn/integration/report.py): layer counts, and each
part that is off with its reason."""

import paddle_fastffn
from llama_fixtures import tiny_model
from paddle_fastffn.integration.report import fast_path_report, report_line


def test_a_model_built_on_the_fast_path_runs_every_part():
    paddle_fastffn.apply_fast_ffn_to_llama()
    report = fast_path_report(tiny_model())
    assert (report["fast_path_layers"], report["decoder_layers"], report["off"]) == (2, 2, {})
    # What the fast path changed in the config is said, not done silently (fast_ffn_attention and
    # fast_ffn_fuse_projections; the saved config keeps the stock values).
    assert report_line(report) == (
        "paddle_fastffn: 2/2 LLaMA decoder layers on the fast path; every part on; attention through SDPA where the "
        "config says use_flash_attention=false; projections fused where the config says "
        "fuse_attention_qkv/fuse_attention_ffn=false (checkpoints stay unfused)")


def test_switches_turned_off_and_stock_layers_are_named_with_their_reason():
    paddle_fastffn.apply_fast_ffn_to_llama(rotary=False, fused_optimizer=False)
    model = tiny_model()
    model.config.tensor_parallel_degree = 2  # what a sharded head's config says (not run: no TP on CPU)
    report = fast_path_report(model)
    assert report["off"]["rotary"] == "fast_ffn_rotary=false"
    assert report["off"]["fused_optimizer"] == "fast_ffn_fused_optimizer=false"
    assert "tensor_parallel_degree=2" in report["off"]["fused_cross_entropy"]
    line = report_line(report)
    assert line.startswith("paddle_fastffn: 2/2 LLaMA decoder layers on the fast path; off: ")
    assert "rotary (fast_ffn_rotary=false)" in line


def test_a_model_built_before_enabling_reports_its_unfused_projections():
    model = tiny_model()
    paddle_fastffn.apply_fast_ffn_to_llama(model)
    report = fast_path_report(model)
    assert "qkv fused in 0/2 layers, gate_up in 0/2" in report["off"]["fuse_projections"]
    assert "built before the fast path was enabled" in report["off"]["swiglu_recompute"]


def test_stock_reports_nothing_patched():
    report = fast_path_report(tiny_model())
    assert report == {"use_fast_ffn": False, "decoder_layers": 2, "fast_path_layers": 0, "off": {}, "notes": []}


def test_the_fp8_lm_head_is_said():
    paddle_fastffn.apply_fast_ffn_to_llama(precision="fp8", fp8_emulate=True, fp8_lm_head="fp8")
    assert "the LM head + loss's GEMMs in FP8 too (fast_ffn_fp8_lm_head=fp8)" in report_line(fast_path_report(tiny_model()))
    paddle_fastffn.revert_fast_ffn()
    paddle_fastffn.apply_fast_ffn_to_llama(precision="fp8", fp8_emulate=True)
    assert "LM head" not in report_line(fast_path_report(tiny_model()))


def test_an_fp8_lm_head_the_model_cannot_take_is_said_as_such():
    paddle_fastffn.apply_fast_ffn_to_llama(precision="fp8", fp8_emulate=True, fp8_lm_head="fp8")
    line = report_line(fast_path_report(tiny_model(vocab_size=120)))
    assert ("fast_ffn_fp8_lm_head=fp8 asked for, but the LM head stays 16-bit: hidden size 64 or vocabulary 120 is "
            "not a multiple of 16") in line and "GEMMs in FP8 too" not in line
