"""How the plugin reaches processes that `python -m paddle_fastffn` starts (paddle_fastffn/_bootstrap):
PADDLE_FASTFFN_PLUGIN=1 and the bootstrap folder on PYTHONPATH load the import hook at interpreter
start, after any sitecustomize it shadows; without the variable nothing happens."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from paddle_fastffn.plugin import BOOTSTRAP_DIR

REPO = Path(__file__).resolve().parents[2]

CHILD = textwrap.dedent("""
    import os, sys
    print("SHADOWED_RAN", os.environ.get("SHADOWED_SITECUSTOMIZE_RAN"))
    print("HEAVY_BEFORE", "paddle" in sys.modules)
    from paddlenlp.trainer import TrainingArguments
    print("FIELD", "use_fast_ffn" in TrainingArguments.__dataclass_fields__)
""")


def run_child(tmp_path, plugin: bool) -> str:
    shadowed = tmp_path / "site"
    shadowed.mkdir(exist_ok=True)
    (shadowed / "sitecustomize.py").write_text("import os\nos.environ['SHADOWED_SITECUSTOMIZE_RAN'] = 'yes'\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(BOOTSTRAP_DIR), str(shadowed), str(REPO)]))
    env.pop("PADDLE_FASTFFN_PLUGIN", None)
    if plugin:
        env["PADDLE_FASTFFN_PLUGIN"] = "1"
    result = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_started_processes_get_the_fields_and_the_shadowed_sitecustomize_still_runs(tmp_path):
    out = run_child(tmp_path, plugin=True)
    assert "SHADOWED_RAN yes" in out
    assert "HEAVY_BEFORE False" in out  # the hook imports nothing until paddlenlp.trainer is imported
    assert "FIELD True" in out


def test_without_the_variable_paddlenlp_is_untouched(tmp_path):
    out = run_child(tmp_path, plugin=False)
    assert "SHADOWED_RAN yes" in out and "FIELD False" in out


def test_a_trainer_class_is_wrapped_to_report_once():
    """A second install (the hook run again, or both libraries' modules extending one Trainer) must not
    wrap its __init__ twice: one report line, one exit handler."""
    from paddle_fastffn import plugin

    class Trainer:
        def __init__(self):
            pass

    plugin._report_when_built(Trainer)
    wrapped = Trainer.__init__
    plugin._report_when_built(Trainer)
    assert Trainer.__init__ is wrapped and wrapped._fast_ffn_reports
