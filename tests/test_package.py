"""The package a user installs: ``pip install .`` gives a ``mtad`` command that runs from any folder, with the
embedded pair, presets and prompts inside the package."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_wheel_carries_the_assets_and_a_mtad_command_that_runs_from_any_folder(tmp_path):
    built = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            str(ROOT),
            "-w",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert built.returncode == 0, built.stderr[-3000:]
    wheel = next(tmp_path.glob("mtad-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    for shipped in (
        "mtad/assets/pairs.toml",
        "mtad/assets/models/target/model.safetensors",
        "mtad/assets/prompts/code.jsonl",
    ):
        assert shipped in names, shipped
    assert not any(n.startswith(("tests/", "training/", "assets/")) for n in names)
    site = tmp_path / "site"
    installed = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(wheel)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert installed.returncode == 0, installed.stderr[-3000:]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {**os.environ, "PYTHONPATH": str(site)}

    def mtad(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [str(site / "bin" / "mtad"), *args], cwd=elsewhere, env=env, capture_output=True, text=True, timeout=600
        )

    helped = mtad("--help")
    assert helped.returncode == 0 and all(
        c in helped.stdout for c in ("generate", "bench", "tuning", "audit", "kernels")
    )
    ran = mtad("generate", "--pair", "embedded", "--prompt", "def add(a, b):", "--max-new-tokens", "6", "--json")
    assert ran.returncode == 0, ran.stderr[-3000:]
    out = json.loads(ran.stdout)
    assert out["pair"] == "embedded" and 0 < len(out["new_ids"]) <= 6
    where = subprocess.run(
        [sys.executable, "-c", "import mtad; print(mtad.__file__)"],
        cwd=elsewhere,
        env=env,
        capture_output=True,
        text=True,
    )
    assert where.stdout.strip().startswith(str(site))  # the installed copy ran, not the checkout
