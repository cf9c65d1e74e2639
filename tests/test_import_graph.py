"""The product's import graph, read from the source with ast (nothing is imported, so this runs in
either environment, with or without torch and Paddle): every `import` and `from ... import` of
every module under paddle_fastffn/, function-level ones included (an import deferred into a function
to dodge a circle is still the circle).

- No product module imports benchmarks/ or tests/: the drivers depend on the product, never the
  other way round.
- No import circle in the product, except the ones listed in KNOWN_CIRCLES, which are to be
  removed (a listed circle that no longer exists fails too, so the list only shrinks).
- The model patch (integration/) does not import the fine-tune layer above it (finetune/).
- The torch binding (paddle_fastffn/torch) has no circle at all, and no other part of the product
  imports it: `import paddle_fastffn` and the Paddle binding never need torch.
- `import paddle_fastffn`, the framework-neutral core and the torch binding's torch-free modules
  import in a process where torch, Paddle and PaddleNLP cannot be imported.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = "paddle_fastffn"
TORCH_BINDING = "paddle_fastffn.torch"

# Circles that exist today, each to be broken (then removed from here).
KNOWN_CIRCLES: set = set()  # a circle found later is added here with why, to be removed


def modules() -> dict[str, tuple[Path, bool]]:
    """{dotted name: (file, is a package's __init__)} of every module under paddle_fastffn/."""
    found = {}
    for path in (REPO / PACKAGE).rglob("*.py"):
        parts = list(path.relative_to(REPO).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        found[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return found


def imports(path: Path, name: str, is_package: bool) -> list[tuple[str, list[str]]]:
    """What `path` imports: (absolute module, [names taken from it]) per statement; `import a.b`
    is ("a.b", []). Relative imports are resolved against the module's package."""
    package = name if is_package else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
            found.append((base, [alias.name for alias in node.names]))
    return found


def graph() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(edges between product modules, every imported module name per module). `from pkg import
    name` is an edge to pkg.name where that is a module, else to pkg (its nearest module); a
    module's parent packages are not counted (their __init__ files import nothing of it eagerly)."""
    found = modules()

    def nearest(module: str) -> str | None:
        while module and module not in found:
            module = module.rpartition(".")[0]
        return module or None

    edges, raw = {}, {}
    for name, (path, is_package) in found.items():
        targets, names = set(), set()
        for base, taken in imports(path, name, is_package):
            names.add(base)
            for item in taken or [None]:
                full = f"{base}.{item}" if item else base
                names.add(full)
                targets.add(full if full in found else nearest(base))
        targets.discard(None)
        targets.discard(name)
        edges[name], raw[name] = targets, names
    return edges, raw


def circles(edges: dict[str, set[str]]) -> list[frozenset[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    counter = 0
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, successors = work[-1]
            advanced = False
            for successor in successors:
                if successor not in index:
                    index[successor] = low[successor] = counter
                    counter += 1
                    stack.append(successor)
                    on_stack.add(successor)
                    work.append((successor, iter(sorted(edges[successor]))))
                    advanced = True
                    break
                if successor in on_stack:
                    low[node] = min(low[node], index[successor])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(frozenset(component))
    return found


def test_graph_sees_function_level_and_relative_imports():
    edges, _ = graph()
    # recipe imports scaling only inside methods; scaling imports formats relatively
    assert "paddle_fastffn.core.fp8.scaling" in edges["paddle_fastffn.core.fp8.recipe"]
    assert "paddle_fastffn.core.fp8.formats" in edges["paddle_fastffn.core.fp8.scaling"]
    assert "paddle_fastffn.torch.c_api" in edges["paddle_fastffn.torch.ops"]
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [frozenset("abc")]


def test_no_product_module_imports_benchmarks_or_tests():
    _, raw = graph()
    offending = sorted(f"{module} imports {name}" for module, names in raw.items() for name in names
                       if name.split(".")[0] in ("benchmarks", "tests"))
    assert not offending, offending


def test_no_import_circles_but_the_known_ones():
    found = set(circles(graph()[0]))
    new = [sorted(c) for c in found - KNOWN_CIRCLES]
    assert not new, f"import circles in paddle_fastffn: {new}"
    gone = [sorted(c) for c in KNOWN_CIRCLES - found]
    assert not gone, f"no longer circles (remove them from KNOWN_CIRCLES): {gone}"


def test_the_model_patch_does_not_import_the_fine_tune_layer_above_it():
    edges, _ = graph()
    upward = sorted((m, t) for m, targets in edges.items() if m.startswith("paddle_fastffn.integration")
                    for t in targets if t.startswith("paddle_fastffn.finetune"))
    assert not upward, f"paddle_fastffn.integration imports paddle_fastffn.finetune: {upward}"


def test_torch_binding_is_a_leaf_without_circles():
    edges, _ = graph()
    inside = lambda name: name == TORCH_BINDING or name.startswith(TORCH_BINDING + ".")  # noqa: E731
    assert not [c for c in circles(edges) if any(inside(m) for m in c)]
    users = sorted(m for m, targets in edges.items() if not inside(m) and any(inside(t) for t in targets))
    assert not users, f"modules outside the torch binding that import it: {users}"


def test_package_core_and_torch_free_modules_import_without_torch_or_paddle():
    core = sorted(m for m in modules() if m == "paddle_fastffn.core" or m.startswith("paddle_fastffn.core."))
    wanted = ["paddle_fastffn", *core, TORCH_BINDING, f"{TORCH_BINDING}.build", f"{TORCH_BINDING}.c_structs"]
    script = f"""
import importlib, importlib.abc, sys
class Blocked(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "paddle", "paddlenlp"):
            raise ImportError("blocked: " + name)
sys.meta_path.insert(0, Blocked())
for name in {wanted!r}:
    importlib.import_module(name)
"""
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
