"""The FP8 path of the torch binding: the C API's FP8 entry points (c_api), core/fp8's backend over
them (backend) and the FP8 linear and FFN as torch Functions (linear, ffn)."""
