"""README.md as a newcomer reads it: its Python example runs as written, its two set-up commands are the
ones CI runs, and it stays short."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def test_the_python_example_runs_as_written(tmp_path):
    """Run from another folder, as a user's script would, with the checkout on the path (an installed package
    would be found the same way)."""
    blocks = [b for b in python_blocks(README) if "import mtad" in b]
    assert len(blocks) == 1, "README.md holds one Python example that imports mtad"
    script = tmp_path / "example.py"
    script.write_text(blocks[0], encoding="utf-8")
    done = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip(), "the example prints what it generated"


def test_the_readme_is_short_and_keeps_its_two_commands():
    assert len(README.splitlines()) <= 180
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert "python -m pytest -q" in README and "python -m pytest -q" in ci
    assert "python app.py" in README
