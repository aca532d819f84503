#!/bin/bash
# The GPU checks of docs/gpu.md in one go: every method on cuda against the CPU, plain transformers
# beside kvbudget (scripts/gpu_probe.py), the 7B random-weight bench, then the suite with cuda as
# torch's default device. Writes logs and results to $OUT (default runs/gpu).
#
#   bash scripts/gpu_check.sh                   # on a machine with a GPU and the project installed
#   BENCH_S=235 SUITE_END=0 bash scripts/gpu_check.sh   # cap the bench at 235 s, skip the suite
#   PROBE_S=0 BENCH_S=0 bash scripts/gpu_check.sh       # skip the probe and the bench
#
# On a machine without network, put the wheels the GPU's Python lacks in .gpu/whl, a KVBUDGET_HOME
# with the needle data in .gpu/home, and the model folder of scripts/random_model_dir.py in
# .gpu/qwen7b (docs/gpu.md, "Reproducing on a lent machine").
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-runs/gpu}
mkdir -p "$OUT"
T0=$(date +%s)
PY=${PY:-python3}
if [ -d .gpu/whl ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .gpu/whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD/src
fi
export PYTHONUNBUFFERED=1
MODEL=.gpu/qwen7b
[ -d "$MODEL" ] || { MODEL=runs/qwen2.5-7b; $PY scripts/random_model_dir.py "$MODEL" --max-positions 131072 || exit 1; }
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  uname -r
  $PY -c "import torch, transformers, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"
  nproc
} > "$OUT/gpu.txt" 2>&1
echo "setup $(( $(date +%s) - T0 )) s" >> "$OUT/gpu.txt"

# 1. every method on cuda against the CPU (torch's default device stays the CPU)
timeout 70 $PY -m pytest -q -p no:cacheprovider tests/test_device.py --device cuda -rf --tb=short \
  > "$OUT/device_tests.log" 2>&1
echo "device tests rc=$? at $(( $(date +%s) - T0 )) s" >> "$OUT/gpu.txt"

# 2. one process, one model load: plain transformers decoding beside kvbudget's, and torch.profiler
[ -d .gpu/home ] && export KVBUDGET_HOME=$PWD/.gpu/home
if [ "${PROBE_S:-300}" -gt 0 ]; then
  timeout "${PROBE_S:-300}" $PY scripts/gpu_probe.py "$MODEL" --out "$OUT/probe" --lengths 32768,131072 \
    --methods full,snapkv,lava,asl --budget 1024 > "$OUT/probe.log" 2>&1
  echo "probe rc=$? at $(( $(date +%s) - T0 )) s" >> "$OUT/gpu.txt"
fi

# 3. bench: a Qwen2.5-7B-sized model with random weights, bf16, 32K and 128K
[ "${BENCH_S:-290}" -gt 0 ] && timeout "${BENCH_S:-290}" $PY -c "from kvbudget.cli import app; app()" bench --model "$MODEL" --random-weights \
  --dtype bfloat16 --device cuda --methods full,snapkv,lava,asl --budgets 1024 --lengths 32768,131072 \
  --repeats 1 --new-tokens 32 --out /tmp/gpu-bench > "$OUT/bench.log" 2>&1
echo "bench rc=$? at $(( $(date +%s) - T0 )) s" >> "$OUT/gpu.txt"
cp /tmp/gpu-bench/bench.md /tmp/gpu-bench/runs.jsonl /tmp/gpu-bench/bandwidth.json "$OUT/" 2>/dev/null
unset KVBUDGET_HOME

# 4. the suite with cuda as the default device (integration tests need the real models: left out)
left=$(( ${SUITE_END:-560} - ($(date +%s) - T0) ))
if [ $left -gt 30 ]; then
  timeout $left $PY -m pytest -q -p no:cacheprovider -m "not integration" --device cuda -n 16 \
    --timeout 120 -v --tb=line > "$OUT/suite.log" 2>&1
  echo "suite rc=$? in ${left} s cap, at $(( $(date +%s) - T0 )) s" >> "$OUT/gpu.txt"
fi
