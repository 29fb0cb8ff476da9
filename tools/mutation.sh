#!/usr/bin/env bash
# Mutation-test one mtad module with mutmut against a chosen, fast selection of tests.
#
#   tools/mutation.sh MODULE TEST [TEST ...]
#   tools/mutation.sh mtad/metrics.py tests/test_metrics.py
#
# Works on a scratch copy in ${MUTATION_DIR:-/tmp/mtad-mutation}/<module name>, so the checkout is
# never touched; prints mutmut's per-mutant results and the score. Needs `pip install mutmut`
# (3.x); one thread, one child, because the tests are CPU-bound. See docs/dev/mutation.md.
set -euo pipefail

if [ $# -lt 2 ]; then
  echo "usage: $0 MODULE TEST [TEST ...]   e.g. $0 mtad/metrics.py tests/test_metrics.py" >&2
  exit 2
fi
module=$1
shift
repo=$(cd "$(dirname "$0")/.." && pwd)
[ -f "$repo/$module" ] || { echo "no such module: $module" >&2; exit 2; }
name=$(basename "$module" .py)
work=${MUTATION_DIR:-/tmp/mtad-mutation}/$name
export MTAD_CPU_THREADS=1 OMP_NUM_THREADS=1

rm -rf "$work"
mkdir -p "$work"
# the files git tracks or would track: no virtual environment, caches or training shards
git -C "$repo" ls-files -z --cached --others --exclude-standard | tar -C "$repo" --null -T - -cf - | tar -C "$work" -xf -
tests=$(printf '    %s\n' "$@")
cat > "$work/setup.cfg" <<EOF
[mutmut]
source_paths = mtad
only_mutate = $module
also_copy =
    assets
pytest_add_cli_args = -p no:cacheprovider -q -x
pytest_add_cli_args_test_selection =
$tests
EOF
# mutmut reads pyproject.toml's [tool.mutmut] first: drop any so setup.cfg above applies
python - "$work/pyproject.toml" <<'PY'
import re, sys
path = sys.argv[1]
text = open(path).read()
open(path, "w").write(re.sub(r"(?ms)^\[tool\.mutmut\].*?(?=^\[|\Z)", "", text))
PY

cd "$work"
mutmut run --max-children 1 >mutmut.out 2>mutmut.err || { cat mutmut.err >&2; exit 1; }
if grep -q "failed to collect stats" mutmut.out; then
  # the selected tests fail unmutated under mutmut's trampolines (e.g. a test that monkeypatches the
  # module's own functions): no mutant can be judged
  tail -n 30 mutmut.out >&2
  exit 1
fi
mutmut results --all true | tee results.txt
python - results.txt "$module" <<'PY'
import collections, sys
counts = collections.Counter(line.rsplit(":", 1)[1].strip() for line in open(sys.argv[1]) if ":" in line)
tested = sum(counts.values()) - counts["skipped"] - counts["not checked"]
killed = counts["killed"] + counts["timeout"]
print(f"{sys.argv[2]}: {killed}/{tested} killed ({100 * killed / max(tested, 1):.0f}%); {dict(counts)}")
PY
