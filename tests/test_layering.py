"""The runtime package stands alone: nothing under ``mtad/`` imports the trainers (``training/``), and
only ``mtad/ui/`` imports Gradio, so the library installs and runs without either. Inside it the packages
are layers: the model side (``mtad/models/``) imports no other part of mtad, and only the page
(``mtad/ui/``) imports the page."""

from __future__ import annotations

import ast
from pathlib import Path

MTAD = Path(__file__).resolve().parents[1] / "mtad"


def imported_roots(path: Path) -> set[str]:
    """Top-level names of every module ``path`` imports (at any depth: lazy imports count)."""
    roots = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            roots |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    return roots


def imported_modules(path: Path) -> set[str]:
    """Full dotted names of every module ``path`` imports from (at any depth: lazy imports count)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
    return names


def test_scan_sees_lazy_imports(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from training.chat_draft import chat_prompts\n    import gradio as gr\n")
    assert imported_roots(probe) == {"training", "gradio"}


def test_runtime_never_imports_the_trainers_and_only_the_ui_imports_gradio():
    files = sorted(MTAD.rglob("*.py"))
    assert len(files) > 20
    for path in files:
        roots = imported_roots(path)
        assert "training" not in roots, path
        if "ui" not in path.relative_to(MTAD).parts:
            assert "gradio" not in roots, path


def test_the_model_side_imports_no_other_part_of_mtad_and_only_the_page_imports_the_page():
    files = sorted(MTAD.rglob("*.py"))
    models = [p for p in files if p.relative_to(MTAD).parts[0] == "models"]
    assert len(models) >= 6
    for path in models:
        ours = {m for m in imported_modules(path) if m.split(".")[0] == "mtad"}
        assert all(m in ("mtad", "mtad.models") or m.startswith("mtad.models.") for m in ours), (path, ours)
    for path in files:
        if path.relative_to(MTAD).parts[0] != "ui":
            assert not any(m == "mtad.ui" or m.startswith("mtad.ui.") for m in imported_modules(path)), path


def import_graph(package: Path) -> dict[str, set[str]]:
    """Each module of ``package`` and the modules of it that it imports, at any depth (lazy imports count;
    imports only for type checkers, under ``if TYPE_CHECKING:``, do not: they never run). ``from a import b``
    counts as importing ``a.b`` where that is a module, else ``a``; ``importlib.import_module("a.b")`` counts."""
    modules = {}
    for path in package.rglob("*.py"):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        typing_only = {
            id(n)
            for block in ast.walk(tree)
            if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
            for n in ast.walk(block)
        }
        here = name if path.name == "__init__.py" else name.rpartition(".")[0]
        wanted = set()
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            if isinstance(node, ast.Import):
                wanted |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = here.split(".")[: len(here.split(".")) - node.level + 1]
                    base = ".".join([*parts, base] if base else parts)
                wanted |= {f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names}
            elif isinstance(node, ast.Call) and ast.unparse(node.func).endswith("import_module") and node.args:
                if isinstance(node.args[0], ast.Constant):
                    wanted.add(node.args[0].value)
        graph[name] = {m for m in wanted if m in modules and m != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import graph's strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_the_cycle_finder_sees_a_lazy_cycle_and_ignores_type_checking_imports(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.b import f\n")
    (pkg / "b.py").write_text("def f():\n    from pkg import c\n")
    (pkg / "c.py").write_text("import importlib\nimportlib.import_module('pkg.a')\n")
    (pkg / "d.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.e import x\n")
    (pkg / "e.py").write_text("import pkg.d\n")
    graph = import_graph(pkg)
    assert graph["pkg.b"] == {"pkg.c"} and graph["pkg.d"] == set()
    assert cycles(graph) == [["pkg.a", "pkg.b", "pkg.c"]]


def test_no_module_of_mtad_is_in_an_import_cycle_lazy_imports_included():
    graph = import_graph(MTAD)
    assert len(graph) > 80
    assert cycles(graph) == []


def test_the_bottom_layers_import_nothing_above_them():
    """Settings check fields only (the method-aware check lives with the registry); the device module stands
    on its own (its one import is the model side's error, which imports nothing); no decoder imports the
    warm-ups, which sit above the decoders and run them."""
    graph = import_graph(MTAD)
    assert graph["mtad.settings"] == set()
    assert graph["mtad.models.devices"] <= {"mtad.models.errors"} and graph["mtad.models.errors"] == set()
    decoders = {m for m in graph if m.startswith("mtad.decoding.") and m != "mtad.decoding.precompile"}
    assert all("mtad.decoding.precompile" not in graph[m] for m in decoders)
    assert "mtad.decoding.precompile" in graph["mtad.decoding"]
