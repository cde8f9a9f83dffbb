#!/usr/bin/env bash
# The GPU leg, one command: the CUDA tests, `orgel demo --device cuda` (its start-up timed),
# compiled stages checked against one CUDA process, one rank's throughput (orgel eager and
# compiled against plain PyTorch eager and torch.compile on the same GPU), then the cost model
# on a 2-stage pipeline sharing the GPU, bf16-mixed on a larger GPT and the step predicted from
# an eager and a compiled profile (COST_S, PREC_S, PRED_S: off unless given). Every log and number
# lands under $OUT (default ./gpu-out) as it is made, so a run cut short still reports. Run
# from the repository root on a machine with a GPU and PyTorch (orgel from this tree):
#   bash benchmarks/gpu.sh
# The device tool here brings back at most 8 files from its own $OUT: run it as
#   OUT=/tmp/g bash benchmarks/gpu.sh; tar czf "$OUT/all.tgz" -C /tmp/g .
# ORGEL_STACKS=30 prints every orgel process's stacks each 30 s: where a slow start waits.
set -u
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/orgel-inductor}
PY=${PYTHON:-python3}
step() {  # step NAME SECONDS COMMAND...: run, keep its log, go on whatever it returns
  local name=$1 limit=$2; shift 2
  [ "$limit" -gt 0 ] || return 0  # NAME_S=0 leaves a step out
  local t0=$SECONDS
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  echo "== $name: exit $? in $((SECONDS - t0)) s" | tee -a "$OUT/summary.log"
}
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv;
  $PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)";
  nproc; } >"$OUT/summary.log" 2>&1
# which call in the caller initializes the CUDA driver before the ranks fork (if one does)
# (off by default since the forked start-up runs: FORK_S=60 turns it on)
step fork_check "${FORK_S:-0}" $PY benchmarks/cuda_fork_check.py
grep -h "call(s)\|failed\|losses" "$OUT/fork_check.log" 2>/dev/null >>"$OUT/summary.log"
# correctness first, side by side: the demo's start-up, compiled stages, the CUDA tests
ORGEL_STACKS=30 step demo "${DEMO_S:-120}" $PY -m orgel demo --device cuda --ranks 2 \
  --steps 20 --no-progress --out "$OUT/demo" &
step compiled "${COMPILED_S:-120}" $PY -m orgel run examples/gpt.py:workload --device cuda \
  --ranks 2 --schedule zb-h1 --microbatches 4 --steps 3 --compile --check &
# the CUDA tests side by side (each starts ranks of its own; one after another they take
# about 6 minutes on an H200 machine)
step tests "${TESTS_S:-240}" $PY -m pytest -q -p no:cacheprovider -m cuda tests/test_cuda.py \
  -n 4 -rA --tb=short --durations=0 &
wait
grep -h "captured, planned\|step time\|first step" "$OUT/demo.log" 2>/dev/null >>"$OUT/summary.log"
grep -h "check vs\|compiling the stages\|Error" "$OUT/compiled.log" 2>/dev/null >>"$OUT/summary.log"
grep -h "passed\|failed\|^FAILED\|^PASSED" "$OUT/tests.log" 2>/dev/null >>"$OUT/summary.log"
# then the timings alone on the GPU, each variant in a fresh process, in each precision of
# PRECISIONS ("32": TF32 matmuls; "bf16-mixed": bfloat16 autocast, where compiling gains more),
# at batch BATCH x 512 tokens (32: the GPU's time a step exceeds the host's launches; at 8 an
# H200's step waits on the host, docs/gpu.md)
for prec in ${PRECISIONS:-32 bf16-mixed}; do
  echo "-- throughput, precision $prec" >>"$OUT/summary.log"
  step "throughput-$prec" "${THROUGHPUT_S:-250}" $PY benchmarks/compiled_throughput.py \
    --device cuda --precision "$prec" --batch "${BATCH:-32}" --timeout "${VARIANT_S:-120}" \
    --out "$OUT/throughput.jsonl"
  grep -h "x$" "$OUT/throughput-$prec.log" 2>/dev/null >>"$OUT/summary.log"
done
# where a compiled stage's step loses to torch.compile's, kernels apart from host time
# (off unless GAP_S gives it seconds; about 150 s on an H200)
step gap "${GAP_S:-0}" $PY benchmarks/compiled_gap.py --device cuda --precision bf16-mixed \
  --batch "${BATCH:-32}" --kernels
grep -h "ms a step\|x$" "$OUT/gap.log" 2>/dev/null >>"$OUT/summary.log"
# a 2-stage pipeline on two ranks sharing the GPU against the cost model, and bf16-mixed on a
# model large enough to profit (off unless COST_S / PREC_S give them seconds: the rest fits 8 minutes)
if [ "${COST_S:-0}" -gt 0 ]; then
  step cost "${COST_S:-90}" $PY benchmarks/cost_model_accuracy.py --device cuda --steps 10 \
    --workloads ${WORKLOADS:-GPT-large}
fi
# the step predicted from an eager and from a compiled profile against measured, 2 ranks
# sharing the GPU (off unless PRED_S gives it seconds)
step prediction "${PRED_S:-0}" $PY benchmarks/compiled_prediction.py --device cuda
grep -h -A3 "pred/meas" "$OUT/prediction.log" 2>/dev/null >>"$OUT/summary.log"
if [ "${PREC_S:-0}" -gt 0 ]; then
  step precision "${PREC_S:-90}" $PY benchmarks/precision.py --device cuda --steps 10 \
    --workload examples/gpt.py:workload_large
fi
cat "$OUT/summary.log"
