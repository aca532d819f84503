#!/bin/bash
# The static-decode measurements of docs/gpu.md ("Static decode") in one call on a lent GPU:
# the static path's device tests, then scripts/static_decode_probe.py. Writes to $OUT (default
# runs/gpu-static). On a machine without network, .gpu/whl holds the transformers wheel.
#   bash scripts/gpu_static_check.sh            # PROBE_S (default 330) caps the probe
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-runs/gpu-static}
mkdir -p "$OUT"
PY=${PY:-python3}
if [ -d .gpu/whl ]; then
  rm -rf /tmp/site
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .gpu/whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD/src
fi
export PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; uname -r
  $PY -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"; } \
  > "$OUT/gpu.txt" 2>&1
timeout 90 $PY -m pytest -q -p no:cacheprovider tests/test_static_decode.py --device cuda -rf --tb=short \
  > "$OUT/tests.log" 2>&1
echo "tests rc=$?" >> "$OUT/gpu.txt"
S=${PROBE_S:-330}
timeout $((S + 30)) $PY scripts/static_decode_probe.py --out "$OUT" --deadline-s "$S" > "$OUT/probe.log" 2>&1
echo "probe rc=$?" >> "$OUT/gpu.txt"
