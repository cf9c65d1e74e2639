"""report_to="visualdl" (PaddleNLP's default) with protobuf 7.

At train start PaddleNLP's VisualDLCallback hands every TrainingArguments field to visualdl's
add_hparams; visualdl 2.5.3 (the newest) writes a bool into the protobuf int field int_value
(visualdl/component/base_component.py: `isinstance(v, int)` is true for bools), which protobuf 5
and 6 store as 0/1 and protobuf 7 rejects: "Field visualdl.Record.HParam.HparamInfo.int_value:
Expected an int, got a boolean" (measured with 6.33.6 and 7.34.0 / 7.36.2, 2026-12-05). The
package pins protobuf<7 (pyproject.toml); where a newer one is installed anyway,
repair_visualdl_hparams() makes visualdl write bools as the 0/1 that protobuf 6 writes.
"""

from __future__ import annotations

import functools


def protobuf_rejects_bool_ints() -> bool:
    from google.protobuf import __version__

    return int(__version__.split(".")[0]) >= 7


def repair_visualdl_hparams() -> bool:
    """Wrap visualdl's hparam record builder so that bool values are written as ints; True where
    it was needed and done (idempotent)."""
    if not protobuf_rejects_bool_ints():
        return False
    from visualdl.writer import writer

    if getattr(writer.hparam, "_fast_ffn_bools_as_ints", False):
        return True
    original = writer.hparam

    @functools.wraps(original)
    def hparam(name, hparam_dict, metric_list, walltime):
        values = {k: int(v) if isinstance(v, bool) else v for k, v in hparam_dict.items()}
        return original(name=name, hparam_dict=values, metric_list=metric_list, walltime=walltime)

    hparam._fast_ffn_bools_as_ints = True
    writer.hparam = hparam
    return True
