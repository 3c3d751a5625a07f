"""The house rules, checked on the tree (docs/design.md, "Layers"): no import cycle between the
project's packages or between its modules (imports inside functions count), runtime/ never imports
export/, nothing imports the development tools, size limits outside tests/, and the ONNX runtime
loads and decodes without torch."""
from __future__ import annotations

import ast
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("artifact", "models", "eagle2", "runtime", "export", "tools", "training")
DEVELOPMENT = ("tools", "training")
MAX_FILE_LINES, MAX_FUNCTION_LINES = 600, 80


def modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    return found


def imports() -> dict[str, set[str]]:
    """Module -> the project's modules it imports, anywhere in its body."""
    known = modules()

    def resolve(name: str) -> str | None:
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = defaultdict(set)
    for module, path in known.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                targets = [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            for target in targets:
                resolved = resolve(target)
                if resolved and resolved != module:
                    graph[module].add(resolved)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan)."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
                on.discard(component[-1])
            if len(component) > 1:
                found.append(sorted(component))

    for v in list(graph):
        if v not in index:
            visit(v)
    return found


def package_graph() -> dict[str, set[str]]:
    packages: dict[str, set[str]] = defaultdict(set)
    for module, targets in imports().items():
        for target in targets:
            if target.split(".")[0] != module.split(".")[0]:
                packages[module.split(".")[0]].add(target.split(".")[0])
    return packages


def test_no_module_cycles():
    assert cycles(imports()) == []


def test_no_package_cycles():
    assert cycles(package_graph()) == []


def test_layers_import_only_downward():
    packages = package_graph()
    assert "export" not in packages["runtime"], "runtime/ must read artifacts through artifact/, not export/"
    assert packages["artifact"] <= {"models"}
    assert packages["eagle2"] == set(), "the algorithm stands alone"
    for package, targets in packages.items():
        if package not in DEVELOPMENT:
            assert not targets & set(DEVELOPMENT), f"{package}/ imports a development tool"


def test_size_limits():
    too_big = []
    for module, path in modules().items():
        source = path.read_text()
        if source.count("\n") > MAX_FILE_LINES:
            too_big.append(f"{path.relative_to(ROOT)}: {source.count(chr(10))} lines")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    too_big.append(f"{path.relative_to(ROOT)}: {node.name} is {lines} lines")
    assert too_big == []


def test_onnx_runtime_decodes_without_torch(tiny_artifact):
    """A deployment with only the runtime's dependencies: torch cannot even be imported."""
    code = f"""
import sys
class NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("torch is not installed here")
sys.meta_path.insert(0, NoTorch())
import runtime
gen = runtime.load({str(tiny_artifact())!r})
out = gen.generate([1, 2, 3, 4], max_new_tokens=8)
assert len(out.token_ids) == 8, out.token_ids
assert not any(m == "torch" or m.startswith("torch.") for m in sys.modules)
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]
