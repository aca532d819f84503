#!/bin/bash
# The GPU checks of docs/gpu.md in one go: every method on cuda against the CPU, plain transformers
# beside kvbudget (scripts/gpu_probe.py), the 7B random-weight bench, then the suite with cuda as
# torch's default device. Writes logs and results to $OUT (default runs/gpu).
#
#   bash scripts/gpu_check.sh                  # on a machine with a GPU and the project installed
#   END_S=400 BENCH_S=0 bash scripts/gpu_check.sh   # all within 400 s, no bench
#   PROBE_S=0 SUITE_S=0 bash scripts/gpu_check.sh   # no probe, no suite
# PROBE_S (default 240), BENCH_S (200) and SUITE_S (600) cap each step; END_S (560) caps them all.
# PROBE_METHODS (default full,snapkv,lava,asl) lists the methods the probe times beside transformers.
#
# On a machine without network, put the wheels the GPU's Python lacks in .gpu/whl, a KVBUDGET_HOME
# with the needle data in .gpu/home, and the model folder of scripts/random_model_dir.py in
# .gpu/qwen7b (docs/gpu.md, "Running the checks on a machine without network").
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-runs/gpu}
mkdir -p "$OUT"
T0=$(date +%s)
PY=${PY:-python3}
if [ -d .gpu/whl ]; then
  rm -rf /tmp/site  # a warm machine keeps the last call's packages
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

# each step runs for at most its own cap and what is left of END_S (default 560 s) from the start
END=${END_S:-560}
cap() { local left=$(( END - ($(date +%s) - T0) )); if [ "$1" -lt "$left" ]; then echo "$1"; else echo "$left"; fi; }

# 2. one process, one model load: plain transformers decoding beside kvbudget's, and torch.profiler
[ -d .gpu/home ] && export KVBUDGET_HOME=$PWD/.gpu/home
s=$(cap "${PROBE_S:-240}")
if [ "$s" -gt 30 ]; then
  timeout "$s" $PY scripts/gpu_probe.py "$MODEL" --out "$OUT/probe" --lengths 32768,131072 \
    --methods "${PROBE_METHODS:-full,snapkv,lava,asl}" --budget 1024 > "$OUT/probe.log" 2>&1
  echo "probe rc=$? in ${s} s cap, at $(( $(date +%s) - T0 )) s" >> "$OUT/gpu.txt"
fi

# 3. bench: a Qwen2.5-7B-sized model with random weights, bf16, 32K and 128K (rows kept as they finish)
s=$(cap "${BENCH_S:-200}")
if [ "$s" -gt 30 ]; then
  timeout "$s" $PY -c "from kvbudget.cli import app; app()" bench --model "$MODEL" --random-weights \
    --dtype bfloat16 --device cuda --methods full,snapkv,lava,asl --budgets 1024 --lengths 32768,131072 \
    --repeats 1 --new-tokens 32 --out "$OUT/bench" > "$OUT/bench.log" 2>&1
  echo "bench rc=$? in ${s} s cap, at $(( $(date +%s) - T0 )) s" >> "$OUT/gpu.txt"
fi
unset KVBUDGET_HOME

# 4. the suite with cuda as the default device (integration tests need the real models: left out)
s=$(cap "${SUITE_S:-600}")
if [ "$s" -gt 30 ]; then
  timeout "$s" $PY -m pytest -q -p no:cacheprovider -m "not integration" --device cuda -n 16 \
    --timeout 120 -v --tb=line > "$OUT/suite.log" 2>&1
  echo "suite rc=$? in ${s} s cap, at $(( $(date +%s) - T0 )) s" >> "$OUT/gpu.txt"
fi
