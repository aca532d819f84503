#!/bin/bash
# The static-decode measurements of docs/gpu.md ("Static decode") in one call on a lent GPU:
# the static path's device tests, scripts/static_decode_probe.py, then `kvbudget bench --decode static`
# on the 7B random-weight model at 32K (BENCH_METHODS), then `kvbudget bench serve` on the same model
# at 32K (full vs snapkv under one KV cap: issue #47's GPU row). Writes to $OUT (default runs/gpu-static).
# On a machine without network, .gpu/ holds what scripts/gpu_check.sh describes.
#   bash scripts/gpu_static_check.sh   # PROBE_S (default 330) and BENCH_S (240) cap the steps;
#   PROBE_SKIP=compiled,dynamic        # leaves probe phases out (static, static-compiled, batch, hf,
#                                      # attention, compiled, dynamic); BENCH_S=0 skips the bench
#   BENCH_DECODE=static-compiled       # the bench's decode path (default static)
#   SERVE_S (default 200) caps the serving bench; SERVE_S=0 skips it
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
timeout 150 $PY -m pytest -q -p no:cacheprovider tests/test_static_decode.py --device cuda -rf --tb=short \
  > "$OUT/tests.log" 2>&1
echo "tests rc=$?" >> "$OUT/gpu.txt"
S=${PROBE_S:-330}
if [ "$S" -gt 0 ]; then
  timeout $((S + 30)) $PY scripts/static_decode_probe.py --out "$OUT" --deadline-s "$S" \
    --skip "${PROBE_SKIP:-}" > "$OUT/probe.log" 2>&1
  echo "probe rc=$?" >> "$OUT/gpu.txt"
fi
MODEL=.gpu/qwen7b
[ -d "$MODEL" ] || { MODEL=runs/qwen2.5-7b; $PY scripts/random_model_dir.py "$MODEL" --max-positions 131072; }
[ -d .gpu/home ] && export KVBUDGET_HOME=$PWD/.gpu/home
B=${BENCH_S:-240}
if [ "$B" -gt 0 ]; then
  timeout "$B" $PY -c "from kvbudget.cli import app; app()" bench --model "$MODEL" --random-weights \
    --dtype bfloat16 --device cuda --methods "${BENCH_METHODS:-full,snapkv,ada-snapkv,lava,cake,d2o}" \
    --budgets 4096 --lengths 32768 --repeats 1 --new-tokens 32 --decode "${BENCH_DECODE:-static}" --out "$OUT/bench" \
    > "$OUT/bench.log" 2>&1
  echo "bench rc=$?" >> "$OUT/gpu.txt"
fi
V=${SERVE_S:-200}
if [ "$V" -gt 0 ]; then  # the default cap: what two full-cache conversations of 32K need
  timeout "$V" $PY -c "from kvbudget.cli import app; app()" bench serve --model "$MODEL" --random-weights \
    --dtype bfloat16 --device cuda --methods full,snapkv --ratio 0.875 --length 32000 --clients 8 \
    --requests 8 --max-tokens 64 --time-limit $((V / 2 - 10)) --out "$OUT/serve" > "$OUT/serve.log" 2>&1
  echo "serve rc=$?" >> "$OUT/gpu.txt"
fi
