#!/usr/bin/env bash
# One call on the GPU machine: GPU tests, then training/benchmark runs; everything lands in
# $OUT/results.tar.gz (+ summary.txt), since only a few files come back.
#   STAGES="tests train1b" bash scripts/gpu_suite.sh
# TESTS_K="budget" runs only the GPU tests matching that -k expression.
# One device call runs at most 600 s: "tests" (~100 s) and "soak" (~400 s) fit together, not with a bench.
set -u
OUT=${OUT:-/tmp/out}
R=/tmp/megatrain_results
mkdir -p "$R" "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
STAGES=${STAGES:-"tests train1b"}
# Every stage's timeout is cut to what is left of the call (BUDGET_S, default 585 s of the 600 s
# limit), so the results of the stages that ran are packed before the device call is killed.
DEADLINE=$(( $(date +%s) + ${BUDGET_S:-585} ))
left() { local l=$(( DEADLINE - $(date +%s) - 10 )); [ "$l" -lt "$1" ] && echo $(( l > 1 ? l : 1 )) || echo "$1"; }
summary() { echo "$*" | tee -a "$R/summary.txt"; }
summary "commit ${MEGATRAIN_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)} $(date -u +%FT%TZ) stages: $STAGES"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >> "$R/summary.txt" 2>&1
python3 -c "import torch,transformers,accelerate,peft,sys;print(sys.version.split()[0],torch.__version__,transformers.__version__,accelerate.__version__,peft.__version__)" >> "$R/summary.txt" 2>&1
nproc >> "$R/summary.txt"; free -g | head -2 >> "$R/summary.txt"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >> "$R/pip.log" 2>&1 && export PYTHONPATH=/tmp/site:$PYTHONPATH
fi
for stage in $STAGES; do
  start=$(date +%s)
  case $stage in
    probe)
      python3 scripts/host_probe.py > "$R/probe.log" 2>&1
      summary "probe rc=$? $(cat "$R/probe.log" | tail -12)";;
    tests)
      MEGATRAIN_GPU_REPORT=$R/gpu_parity.jsonl timeout $(left 420) python3 -m pytest -m gpu tests/gpu -q -rs ${TESTS_K:+-k "$TESTS_K"} > "$R/gpu_tests.log" 2>&1
      summary "tests rc=$? $(tail -1 "$R/gpu_tests.log")";;
    train1b)
      for sys in ${TRAIN1B_SYSTEMS:-megatrain plain}; do
        timeout $(left 300) python3 scripts/gpu_train.py --system $sys --steps 20 --checkpointing --out "$R/train1b_$sys.json" > "$R/train1b_$sys.log" 2>&1
        summary "train1b $sys rc=$? $(tail -1 "$R/train1b_$sys.log" | cut -c1-400)"
      done;;
    soak)
      timeout $(left 450) python3 scripts/gpu_soak.py ${SOAK_ARGS:---model llama-1.36b --layers 8 --seq-len 1024 --micro-batch 4 --grad-accum 2 --steps 500 --save-steps 250 --from-step 300} --out "$R/soak.json" > "$R/soak.log" 2>&1
      summary "soak rc=$? $(tail -1 "$R/soak.log" | cut -c1-600)";;
    bench*)
      # BENCH_ARGS_<stage> holds the arguments, e.g. BENCH_ARGS_bench3b="--model llama-3.14b ..."
      var="BENCH_ARGS_${stage}"
      [ -d "out/$stage" ] && cp -r "out/$stage" "$R/$stage"  # earlier results, for --merge
      cfg="CONFIG_${stage}"  # megatrain options for this stage only, e.g. CONFIG_bench7b_cap='{"max_gpu_memory": "24GiB"}'
      MEGATRAIN_CONFIG=${!cfg:-${MEGATRAIN_CONFIG:-}} timeout $(left 540) python3 -m megatrain_hf.cli bench ${!var} --out "$R/$stage" > "$R/$stage.log" 2>&1
      summary "$stage rc=$? $(tail -3 "$R/$stage.log" | cut -c1-600)"
      # --profile: a text summary of each trace goes in the tarball, the trace itself (gzipped) beside it if small
      for trace in "$R/$stage"/logs/*.trace.json; do
        [ -f "$trace" ] || continue
        name=$stage-$(basename "$trace" .json.trace.json)
        timeout $(left 60) python3 scripts/trace_summary.py "$trace" > "$R/$name-trace.txt" 2>&1
        gzip -1 "$trace" && mv "$trace.gz" "/tmp/$name-trace.json.gz"
        [ "$(stat -c %s "/tmp/$name-trace.json.gz")" -lt 15000000 ] && cp "/tmp/$name-trace.json.gz" "$OUT/"
      done;;
    *) summary "unknown stage $stage";;
  esac
  summary "stage $stage took $(( $(date +%s) - start )) s"
  tar -czf "$OUT/results.tar.gz" -C "$R" .  # after every stage: a later timeout keeps what ran
  cp "$R/summary.txt" "$OUT/summary.txt"
done
cat "$R/summary.txt"
