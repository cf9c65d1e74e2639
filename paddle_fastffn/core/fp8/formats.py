"""The FP8 formats' limits, which the recipe and the scaling states both read (apart from the recipe,
which builds the states: no import circle between them)."""

# Largest finite values: e4m3 (OCP "fn": no Inf, one NaN per sign) S.1111.110 = 448;
# e5m2 (IEEE-like) S.11110.11 = 57344.
FP8_MAX = {"e4m3": 448.0, "e5m2": 57344.0}


def check_format(fmt: str) -> str:
    if fmt not in FP8_MAX:
        raise ValueError(f"unknown FP8 format {fmt!r}; expected one of {sorted(FP8_MAX)}")
    return fmt
