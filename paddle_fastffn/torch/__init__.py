"""The torch binding: the product's framework-neutral layer (paddle_fastffn/core) run over the C API's
kernels with torch, the way the GPU machine (torch, no Paddle) executes it.

    c_structs, build      ctypes mirrors of the C API's structs; the build definition (no torch)
    c_api, fp8.c_api      the C API through ctypes (build, load, one method per entry point)
    backend, fp8.backend, optimizer
                          core's backends over those kernels and torch's GEMMs; backend.function(op)
                          is torch's autograd adapter for a core fused op
    ops, fp8.ffn, fp8.linear
                          the fused ops as torch Functions (the counterpart of paddle_fastffn.ops)
    llama                 the LLaMA decoder layer, model and optimizer composed as the Paddle patch
                          composes them (core/decoder.py)
    cpu_kernels           select(): the same binding on CPU tensors (C API CPU kernels, FP8 emulated)

Nothing here is imported by `import paddle_fastffn`; import these modules where torch is installed
(c_structs and build need no torch). No module here imports benchmarks/ (tests/test_import_graph.py).
"""
