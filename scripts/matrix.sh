#!/usr/bin/env bash
# scripts/matrix.sh ENGINE VERSION...   (make vllm-matrix VLLM_VERSIONS="0.22.1 0.24.0 ...",
#                                        make sglang-matrix SGLANG_VERSIONS="0.5.18 0.5.23")
#
# For each release of ENGINE (vllm or sglang): build its environment (scripts/ENGINE-env.sh;
# kept if already there), run kvprop's tests of that engine (pytest -m ENGINE over its test
# files), a fixed walk budget (kvprop fuzz --target ENGINE --workers 1 --max-runs 300
# --seconds 600 --seed 0), for vLLM the step-for-step agreement with kvprop's model (kvprop
# agree --walks 100 --release-rules: what the release lacks of kvprop's model and the rules of
# its finds kvprop fixes, kvprop/targets/vllm/releases.py), and the coverage of the engine's KV
# code (kvprop coverage --seconds $MATRIX_COVERAGE_SECONDS, default 60), then print one row per
# release:
#
#   release | builds | tests (passed/failed) | steps | verdict (clean / found KIND) | agree | coverage
#
# Logs, JSON summaries and any counterexample go under $MATRIX_LOGS (default: a new folder
# under /tmp). A find is a result, not a failure (vLLM releases before 0.24 are expected to
# find block-in-two-groups); the exit status is 1 when a release does not build or a test
# fails or errors, else 0.
set -uo pipefail

ENGINE=${1:-}
case $ENGINE in
  vllm) TESTS="tests/test_vllm_target.py tests/test_vllm_scheduler.py tests/test_vllm_specs.py" ;;
  sglang) TESTS="tests/test_sglang_scheduler.py tests/test_sglang_target.py" ;;
  *) echo "usage: $0 vllm|sglang VERSION...   (e.g. vllm 0.23.0 0.24.0)" >&2; exit 2 ;;
esac
shift
if [ $# -lt 1 ]; then
  echo "usage: $0 $ENGINE VERSION...   (one release at least)" >&2
  exit 2
fi
REPO=$(cd "$(dirname "$0")/.." && pwd)
LOGS=${MATRIX_LOGS:-$(mktemp -d "${TMPDIR:-/tmp}/kvprop-$ENGINE-matrix.XXXXXX")}
MAX_RUNS=${MATRIX_MAX_RUNS:-300}
SECONDS_BUDGET=${MATRIX_SECONDS:-600}
AGREE_WALKS=${MATRIX_AGREE_WALKS:-100}
COVERAGE_SECONDS=${MATRIX_COVERAGE_SECONDS:-60}
mkdir -p "$LOGS"
export VLLM_LOGGING_LEVEL=${VLLM_LOGGING_LEVEL:-ERROR} PYTHONWARNINGS=${PYTHONWARNINGS:-ignore}
export KVPROP_REQUIRE_SGLANG=1 KVPROP_REQUIRE_VLLM=1  # a missing engine fails its tests, never skips them

ROWS=()
status=0
for v in "$@"; do
  log="$LOGS/$v"
  mkdir -p "$log"
  py="$REPO/.venv-$ENGINE-$v/bin/python"
  echo "== $ENGINE $v (logs: $log)" >&2

  t0=$(date +%s)
  if bash "$REPO/scripts/$ENGINE-env.sh" "$v" >"$log/build.log" 2>&1; then
    if grep -q 'already set up' "$log/build.log"; then builds="yes (existing)"; else builds="yes ($(($(date +%s) - t0)) s)"; fi
  else
    echo "   build failed: $(tail -1 "$log/build.log")" >&2
    ROWS+=("$v|no (see $log/build.log)|-|-|-|-|-")
    status=1
    continue
  fi

  # shellcheck disable=SC2086 - TESTS is a list of files
  (cd "$REPO" && KVPROP_PROFILE=${PROFILE:-ci} "$py" -m pytest -q -p no:cacheprovider -m "$ENGINE" \
    $TESTS) >"$log/tests.log" 2>&1
  summary=$(grep -E '^=*.* in [0-9.]+s' "$log/tests.log" | tail -1)
  count() { echo "$summary" | grep -oE "[0-9]+ $1" | grep -oE '^[0-9]+' || echo 0; }
  passed=$(count passed) failed=$(count failed) errors=$(count 'errors?') skipped=$(count skipped)
  tests="$passed/$failed"
  [ "$errors" != 0 ] && tests="$tests, $errors errors"
  [ "$skipped" != 0 ] && tests="$tests ($skipped skipped)"
  if [ -z "$summary" ] || [ "$failed" != 0 ] || [ "$errors" != 0 ]; then
    [ -z "$summary" ] && tests="did not run (see $log/tests.log)"
    status=1
  fi

  (cd "$log" && "$py" -m kvprop fuzz --target "$ENGINE" --workers 1 --max-runs "$MAX_RUNS" \
    --seconds "$SECONDS_BUDGET" --seed 0 --json --out "$log/counterexamples") \
    >"$log/fuzz.json" 2>"$log/fuzz.log"
  if [ "$ENGINE" = vllm ]; then  # kvprop's model of SGLang is its own glue: nothing to agree with
    (cd "$log" && "$py" -m kvprop agree --target vllm --walks "$AGREE_WALKS" --release-rules --json) >"$log/agree.json" 2>"$log/agree.log"
  else
    echo '{"skipped": "no kvprop model of this engine to agree with"}' >"$log/agree.json"
  fi
  (cd "$log" && "$py" -m kvprop coverage --target "$ENGINE" --seconds "$COVERAGE_SECONDS" --json) \
    >"$log/coverage.json" 2>"$log/coverage.log"
  IFS='|' read -r steps verdict agree covered < <("$py" - "$log" <<'PYEOF'
import json, sys
from pathlib import Path

def summary(name, text):
    """One cell from <name>.json, or where to look when the command wrote none."""
    try:
        return text(json.loads((Path(sys.argv[1]) / f"{name}.json").read_text()))
    except Exception:  # noqa: BLE001 - no summary: the run itself failed
        return f"error (see {name}.log)"

def fuzz(s):
    found = s["verdict"] == "found"
    return f"{s['steps']:,}|" + ("found " + (s.get("find") or {}).get("kind", "?") if found else s["verdict"])

def agree(s):
    if "skipped" in s:
        return "-"
    d = s["disagreement"]
    return f"{s['walks']} walks" if d is None else f"differs: seed {d['seed']} {d['what']}"

def coverage(s):
    t = s["total"]
    return f"{t['percent']:.1f}% ({t['percent_statements']:.1f}% statements)"

cells = [summary("fuzz", fuzz), summary("agree", agree), summary("coverage", coverage)]
if "|" not in cells[0]:
    cells[0] = "-|" + cells[0]
print("|".join(cells))
PYEOF
)
  ROWS+=("$v|$builds|$tests|$steps|$verdict|$agree|$covered")
done

{
  echo "release|builds|tests (passed/failed)|steps|verdict|agrees with kvprop|coverage of the KV code"
  printf '%s\n' "${ROWS[@]}"
} | column -t -s '|' -o ' | '
echo "logs: $LOGS"
exit $status
