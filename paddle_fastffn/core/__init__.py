"""The framework-neutral composition layer: what both the Paddle product and the torch GPU harness
execute (design.md, "Layers"). Nothing here imports Paddle or torch; each fused op is written once
over a small tensor backend (`backend.Backend`), and each framework wraps it in its own autograd
(`autograd.FusedOp`): Paddle in paddle_fastffn/ops/_autograd.py, torch in
paddle_fastffn/torch/backend.py. The optimizer step (`optimizer.py`) is written over its own small
backend (`optimizer.OptimizerBackend`: Paddle's in paddle_fastffn/optim/adamw.py, torch's in
paddle_fastffn/torch/optimizer.py). The GPU machine has torch but no Paddle, so `import
paddle_fastffn.core` must stay importable without Paddle (paddle_fastffn/__init__.py is lazy for
that reason)."""
