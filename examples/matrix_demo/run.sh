#!/usr/bin/env bash
# Two runs of the same cases against two releases of an extension, merged into
# one compatibility matrix (as two CI runners would produce and merge them).
#   bash examples/matrix_demo/run.sh [OUTDIR]
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${1:-$(mktemp -d)}
mkdir -p "$out"
python3 "$here/make_inputs.py"
for version in 1.0 2.0; do
    python3 -m pip install --quiet --no-deps --no-build-isolation --target "$out/ext-$version" \
        "$here/ext-$version"
    PYTHONPATH="$out/ext-$version${PYTHONPATH:+:$PYTHONPATH}" python3 -m pytest -p no:cacheprovider \
        --gpu-cases "$here/cases" --gpu-cases-report "$out/report-$version.json" -q || true
done
gpucase matrix "$out/report-1.0.json" "$out/report-2.0.json" --format markdown
gpucase matrix "$out/report-1.0.json" "$out/report-2.0.json" --format html -o "$out/matrix.html"
echo "HTML matrix: $out/matrix.html"
