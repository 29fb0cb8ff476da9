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
