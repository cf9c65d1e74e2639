"""The operator library builds once per cache key, across processes, and loads without
rebuilding afterwards."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from paddle_fastffn.ops import _loader

REPORT = textwrap.dedent(
    """
    import sys
    from paddle_fastffn.ops import _loader
    calls = []
    original = _loader._build
    def counting_build(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)
    _loader._build = counting_build
    _loader.ensure_loaded()
    import paddle
    from paddle_fastffn import ops
    out = ops.swiglu(paddle.to_tensor([[1.0, 2.0]]))
    assert abs(float(out) - 1.4621172) < 1e-5, float(out)
    print("BUILDS", len(calls))
    """
)


def _run(cache: Path, wait: bool = True):
    env = dict(os.environ, PADDLE_FASTFFN_CACHE=str(cache))
    proc = subprocess.Popen([sys.executable, "-c", REPORT], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    return proc.communicate() + (proc.returncode,) if wait else proc


def _builds(stdout: str) -> int:
    return int([line for line in stdout.splitlines() if line.startswith("BUILDS")][0].split()[1])


def test_second_import_does_not_rebuild():
    _loader.ensure_loaded()  # this process's cache is now built
    cache = Path(os.environ.get("PADDLE_FASTFFN_CACHE", Path.home() / ".cache" / "paddle_fastffn"))
    out, err, code = _run(cache)
    assert code == 0, err
    assert _builds(out) == 0


def test_concurrent_cold_starts_build_once(tmp_path):
    procs = [_run(tmp_path, wait=False) for _ in range(2)]
    results = [p.communicate() + (p.returncode,) for p in procs]
    for out, err, code in results:
        assert code == 0, err[-3000:]
    assert sorted(_builds(out) for out, _, _ in results) == [0, 1]
    assert len(list(tmp_path.iterdir())) == 1  # one cache key folder


def test_cache_key_changes_with_flags(monkeypatch):
    before = _loader.cache_key(False)
    monkeypatch.setattr(_loader.definition, "CXX_FLAGS",
                        _loader.definition.CXX_FLAGS + ["-DFASTFFN_TEST_FLAG"])
    assert _loader.cache_key(False) != before


def test_missing_compiler_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("CXX", "no-such-compiler-xyz")
    try:
        _loader.cache_key(False)
    except _loader.FastFFNBuildError as error:
        assert "needs a C++17 compiler" in str(error) and "no-such-compiler-xyz" in str(error)
    else:
        raise AssertionError("expected FastFFNBuildError")


def test_loader_builds_with_the_build_definition(monkeypatch, tmp_path):
    """The loader hands Paddle exactly the definition's sources and flags (the GPU harness and
    tests/build_checks compile from the same definition), CUDA kernels included for a CUDA Paddle."""
    import paddle.utils.cpp_extension as cpp_extension

    calls = []
    monkeypatch.setattr(cpp_extension, "load", lambda **kwargs: calls.append(kwargs))
    monkeypatch.setattr(_loader.shutil, "which", lambda name: f"/usr/bin/{name}")
    definition = _loader.definition
    for cuda in (False, True):
        _loader._build(tmp_path, cuda)
        kwargs = calls[-1]
        assert kwargs["sources"] == [str(s) for s in definition.paddle_sources(cuda)]
        assert kwargs["extra_cxx_cflags"] == definition.CXX_FLAGS
        assert kwargs["extra_cuda_cflags"] == (definition.CUDA_FLAGS if cuda else None)
        cu_files = [s for s in kwargs["sources"] if s.endswith(".cu")]
        assert (len(cu_files) == len(definition.cuda_kernel_sources()) > 0) if cuda else not cu_files
