"""FP8 training's framework-neutral part: the recipe, the per-tensor scaling state machine, the
weight cache with explicit freshness, over the FP8 backend protocol (backend.py)."""
