"""The runtime package stands alone: nothing under ``mtad/`` imports the trainers (``training/``), and
only ``mtad/ui/`` imports Gradio, so the library installs and runs without either."""

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
