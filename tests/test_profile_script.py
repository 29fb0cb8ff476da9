"""``scripts/profile_iterations.py``: its per-iteration figures are the decode's own."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

from mtad.decoding import decode
from mtad.decoding.spec import check
from mtad.models.pair import load_pair
from mtad.settings import Settings

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "profile_iterations.py"


def _script():  # noqa: ANN202
    spec = importlib.util.spec_from_file_location("profile_iterations", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_report_counts_the_decodes_iterations_and_tokens() -> None:
    pair = load_pair("embedded", device="cpu", engine="eager")
    ids = pair.encode("def add(a, b):\n    ")
    settings = check(Settings(method="sd", max_new_tokens=20, seed=0))
    steps = list(decode(pair, ids, settings))
    report = _script().profile_method(pair, ids, settings, rows=3)
    head = report.splitlines()[0]
    match = re.match(r"### sd: (\d+) iterations, ([\d.]+) tokens each, [\d.]+ ms each \(([\d.]+) tokens/s\)", head)
    assert match, head
    assert int(match[1]) == len(steps)
    assert abs(float(match[2]) * len(steps) - sum(len(s.appended_ids) for s in steps)) < 0.01 * len(steps)
    assert "0.0 kernel launches outside graphs" in head  # a CPU launches no kernels
    assert "aten::" in report  # the operators' table follows
