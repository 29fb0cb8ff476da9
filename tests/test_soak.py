"""scripts/soak.py: its memory verdict on hand-made curves, and a short soak of the real page end to end."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

from soak import growth_per_minute  # noqa: E402


def test_memory_growth_is_read_from_the_second_half():
    leaking = [577, 615, 641, 665, 695, 715, 741, 758, 782, 802, 828, 846, 865, 884, 903, 931, 954, 974, 998]
    assert growth_per_minute(leaking) == pytest.approx((998 - 802) / 9)
    warming_then_flat = [600, 650, 660, 661, 661, 662]  # caches fill in the first minutes, then nothing grows
    assert growth_per_minute(warming_then_flat) == pytest.approx(0.5)
    assert growth_per_minute([600, 700, 800]) is None  # too short to tell warming up from growing


def test_a_short_soak_serves_refuses_with_messages_and_strands_nothing(tmp_path):
    pytest.importorskip("gradio_client")
    env = {**os.environ, "MTAD_ENGINE": "eager", "MTAD_TIME_AT_START": "0", "MTAD_CACHE": str(tmp_path / "cache")}
    cmd = [sys.executable, "scripts/soak.py", "--clients", "2", "--minutes", "0.5", "--max-new-tokens", "4"]
    cmd += ["--actions", "run,stop,twice,bad,huge,surrogate,counter", "--log", str(tmp_path / "server.log")]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    out = done.stdout
    assert done.returncode == 0, out + done.stderr[-3000:]
    counts = dict(line.split(": ", 1) for line in out.splitlines() if ": " in line and not line.startswith(" "))
    assert int(counts["served"]) > 0 and int(counts["refused with a message"]) > 0
    assert counts["refused without a message"] == "0" and counts["stranded"] == "0"
    assert counts["a run after the soak served"] == "True"
    assert counts["tracebacks in the server log"].startswith("0 ")
