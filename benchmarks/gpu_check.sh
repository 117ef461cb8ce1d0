#!/usr/bin/env bash
# One prepared run of the GPU checks, under 8 minutes on one GPU:
#   1. pytest -m gpu (the gpu-marked tests)           <= 200 s
#   2. per-item cost on CUDA for each --gpu-isolation  <= 150 s
#   3. item/worker verdict parity on the bundled cases <= 90 s
#   4. comparison on device vs a device-to-device copy <= 30 s
#   5. verdicts on CUDA: false alarms and missed bugs of the verdicts issue's ops <= 180 s
# Results go to $OUT (default ./gpu_check_out) as text and JSON; summary.txt lists each
# part's exit status. On a machine without CUDA parts 2-4 are skipped with the reason
# and part 1's gpu tests are skipped by the suite's conftest: the script still runs end
# to end. Run from the repository root: bash benchmarks/gpu_check.sh
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-./gpu_check_out}"
mkdir -p "$OUT"
PYTHON="${PYTHON:-python}"
summary="$OUT/summary.txt"
: > "$summary"
echo "load average before: $(cut -d' ' -f1-3 /proc/loadavg 2>/dev/null)" >> "$summary"

part() {  # part NAME SECONDS COMMAND...
  local name=$1 limit=$2
  shift 2
  local start=$SECONDS
  timeout --kill-after=10 "$limit" "$@" > "$OUT/$name.log" 2>&1
  local code=$?
  echo "$name: exit $code in $((SECONDS - start)) s (limit $limit s)" >> "$summary"
}

# A bare GPU image has torch and pytest but not this package: install it (no index, no
# build isolation: nothing is fetched), with the pure-Python wheels carried in .whl/
# (tomli-w, pytest-forked; see benchmarks/README.md) when they are missing there.
if ! "$PYTHON" -c "import pytest_gpucase, tomli_w" 2>/dev/null; then
  start=$SECONDS
  {
    if ls .whl/*.whl >/dev/null 2>&1; then
      "$PYTHON" -m pip install -q --no-index --no-deps .whl/*.whl
    fi
    "$PYTHON" -m pip install -q --no-index --no-deps --no-build-isolation -e .
  } > "$OUT/install.log" 2>&1
  echo "install: exit $? in $((SECONDS - start)) s" >> "$summary"
fi

part pytest_gpu 200 "$PYTHON" -m pytest -m gpu -p no:randomly -rs \
  --junitxml="$OUT/pytest_gpu.xml" tests
part cost 150 "$PYTHON" benchmarks/gpu_check.py cost --out "$OUT" --items 12
part parity 90 "$PYTHON" benchmarks/gpu_check.py parity --out "$OUT"
part compare 30 "$PYTHON" benchmarks/gpu_check.py compare --out "$OUT" --mib 256
part verdicts 180 "$PYTHON" benchmarks/bench_verdicts.py rates --seeds 3 --device cuda
echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg 2>/dev/null)" >> "$summary"
"$PYTHON" - "$OUT" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
parts = {p.stem: json.loads(p.read_text()) for p in out.glob("*.json")}
parts["summary"] = (out / "summary.txt").read_text().splitlines()
(out / "gpu_check.json").write_text(json.dumps(parts, indent=2, sort_keys=True) + "\n")
PY
cat "$summary"
