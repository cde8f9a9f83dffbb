#!/usr/bin/env bash
# The GPU leg, one command: the CUDA tests, `orgel demo` and the cost-model and precision
# benchmarks on CUDA, each log under $OUT (default ./gpu-out). Run from the repository root
# on a machine with a GPU and PyTorch installed (orgel from this tree, no install needed):
#   bash benchmarks/gpu.sh
set -u
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
step() {  # step NAME SECONDS COMMAND...: run, keep its log, go on whatever it returns
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  echo "== $name: exit $? in $((SECONDS - t0)) s" | tee -a "$OUT/summary.log"
}
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv;
  $PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)";
  nproc; } >"$OUT/summary.log" 2>&1
# the correctness checks side by side, then the timings alone on the GPU
step tests "${TESTS_S:-140}" $PY -m pytest -q -p no:cacheprovider -m cuda tests/test_cuda.py -rs &
step demo "${DEMO_S:-140}" $PY -m orgel demo --device cuda --ranks 2 --steps 20 --no-progress \
  --out "$OUT/demo" &
wait
step cost "${COST_S:-90}" $PY benchmarks/cost_model_accuracy.py --device cuda --steps 10 \
  --workloads ${WORKLOADS:-GPT-large}
step precision "${PREC_S:-70}" $PY benchmarks/precision.py --device cuda --steps 10 \
  --workload examples/gpt.py:workload_large
cat "$OUT/summary.log"
