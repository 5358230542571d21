#!/usr/bin/env bash
# The project's GPU run, as named stages; a device call runs one or a few of them.
#
#   bash scripts/gpu_suite.sh [--dry-run] STAGE...       (or: STAGES="STAGE ..." bash scripts/gpu_suite.sh)
#   DRY_RUN=1 bash scripts/gpu_suite.sh STAGE...         print every command, run nothing (no GPU needed)
#   bash scripts/gpu_suite.sh --list                     the stages with their time estimates
#
# Limits it is planned for: one call runs at most 600 s wall (BUDGET_S, default 585 s, is what
# this script allows itself: every stage's timeouts are cut to what is left, so the stages that
# ran are packed before the call is killed); all calls together get 30 minutes of device time,
# machine start-up (a minute or more per fresh machine) and idle time included; at most 8 files
# come back from $OUT.
#
# Output, under $OUT (set by the runner; /tmp/out otherwise), named with the commit C
# (MEGATRAIN_COMMIT when the tree's .git is not the source's, else git's short HEAD):
#   $OUT/summary-C.txt      a line per stage and command: exit status, time, the report's last lines
#   $OUT/STAGE-C.json       each bench stage's results.json (per-step times, trends, configs)
#   $OUT/suite-C.tar.gz     every stage's folder: results.json/.md/.png, worker logs, test logs
# so a call should run at most 6 stages. Stages that split one workload over two calls (X and
# X-more) are put side by side afterwards, on any machine, by
#   python -m megatrain_hf.bench.combine --out combined X/results.json X-more/results.json
#
# Stages (estimates from the H200 results in docs/results: one H200, 16 cores, 125 GiB; a worker's
# wall time = fixed cost (process start, model build, Trainer/engine set-up) + steps x step time;
# the first DeepSpeed worker on a fresh machine also compiles DeepSpeed's CPU Adam op, ~60 s):
#   tests                 GPU tests (pytest -m gpu tests/gpu)                           ~140 s (d99d99b: 136 s)
#   baselines-16k         3.14 B, 16K tokens/step (seq 4096 x mb 4 x ga 1), 8 warm-up + 8 measured steps:
#                         megatrain ~85 s (fixed ~55, 1.5 s/step), deepspeed ~150 s (+60 compile; fixed
#                         ~110, 2.5 s/step), deepspeed_zero2 ~140 s (not measured before: fixed ~100,
#                         ~2 s/step guessed), plain ~50 s (1.05 s/step)                  ~425-485 s
#   baselines-16k-more    the same workload: deepspeed_offloadpp ~140 s, deepspeed_zenflow ~160 s (both
#                         not measured before: fixed ~110, ~1.5-2 s/step guessed), fsdp2 ~110 s (fixed
#                         ~40, ~3 s/step guessed from 8.3 s at 4 x 16K)                  ~410-470 s
#   baselines-4x16k       3.14 B, 4 x 16K tokens/step (ga 4), 3 warm-up + 4 measured: megatrain ~80 s
#                         (4.4 s/step), deepspeed ~150 s (+60; 5.6 s/step), plain ~70 s (4.2 s/step)
#                                                                                        ~300-360 s
#   baselines-4x16k-more  the same workload: deepspeed_zero2 ~155 s, deepspeed_offloadpp ~145 s (guessed:
#                         ~6.5 / ~5 s/step), fsdp2 ~100 s (8.3 s/step)                    ~400-460 s
#   1.36b                 1.36 B, 4 micro-batches (seq 2048 x mb 8 x ga 4), 4 warm-up + 6 measured:
#                         megatrain and plain, 2.2 s/step each                           ~115 s
#   7b                    7 B (Llama-2 shape), 8 x 8K (seq 4096 x mb 2 x ga 8), 3 warm-up + 4 measured:
#                         megatrain, 8.7 s/step, fixed ~75 s                             ~165 s
#   qlora-70b             Llama-70B shape, LoRA r=16 on an NF4 base, max_gpu_memory=24GiB, seq 2048 x ga 2,
#                         1 warm-up + 2 measured; the base is drawn and quantized at attach (never fp32):
#                         not measured before, build ~200-300 s guessed                 ~450 s
#   probe                 host update/copy-engine probe (scripts/host_probe.py)          ~20 s
#   disk-13b              the disk tier (offload_dir=DISK_DIR, default /tmp/megatrain-disk, on the local
#                         disk): raw rates (scripts/disk_rates.py, 8 GiB), the estimate, then a full
#                         fine-tune of the Llama-2-13B shape (hidden 5120, fp32 masters, no host staging)
#                         at 64K tokens/step (seq 4096 x mb 1 x ga 16), 1 warm-up + 1 measured step,
#                         as many of its 40 layers as RAM + free disk hold (the estimate's largest depth:
#                         all 40 need ~194 GiB of fp32 state, more than 125 GiB RAM + 64 GiB disk), with
#                         8-bit moments (optimizer_state="8bit", offload_state="moments": all 40 layers fit,
#                         96.98 GiB RAM + 24.62 GiB on disk by the estimate)
#                         not measured yet: ~60 s rates + ~110 s build + 3 x ~60 s/step   ~350 s
#   quality               compressed moments' training quality (scripts/optimizer_state_quality.py): a Llama of
#                         hidden 640 x 8 layers (38.6 M params), 300 steps x 16 x 128 tokens of the demo corpus,
#                         fp32 / 8bit / 4bit side by side (three processes on the one GPU, fp32 compute),
#                         held-out loss every 50 steps; not measured on a GPU before: ~40 s corpus and
#                         tokenizer + ~300 x 0.2 s                                       ~150 s
#   state-3b              the update's cost per optimizer_state: 3.14 B at 16K tokens/step (seq 4096 x mb 4 x
#                         ga 1, the step waits for the update), 3 warm-up + 4 measured, megatrain with fp32,
#                         8bit and 4bit moments in RAM (three bench invocations); ~85 s each ~270 s
#   grad-3b               bf16 gradient accumulators (grad_dtype): 3.14 B at 16K tokens/step as state-3b (ga 1:
#                         the one case where they are exact), megatrain with grad_dtype fp32 and bf16, fp32
#                         moments (two bench invocations); not measured before: ~85 s each       ~180 s
#   disk-13b-ga1          the Llama-2-13B shape, all 40 layers, at 64K tokens/step in one micro-batch (seq 4096 x
#                         mb 16 x ga 1) with the bf16 staging copy, bf16 gradient accumulators and 8-bit moments on
#                         disk (offload_dir=DISK_DIR): `megatrain estimate --model llama-13b --seq-len 4096
#                         --micro-batch 16 --grad-dtype bf16 --optimizer-state 8bit --offload-dir D --offload-state
#                         moments` plans 99.7 GiB of RAM + 24.6 GiB on disk, 73.6 GiB of GPU; 1 warm-up + 1
#                         measured; not measured before: ~110 s build + 3 x ~60 s/step           ~330 s
#   dp-7b                 data parallelism (docs/distributed.md), on a machine with >= 2 GPUs (nvidia-h200-x2):
#                         7 B (Llama-2 shape) at the same tokens per GPU (seq 4096 x mb 2 x ga 4, 32K per GPU
#                         and step), 4 steps, scripts/gpu_train.py under torchrun on 1 and on 2 GPUs; not
#                         measured before: ~75 s fixed + 4 x ~5 s per run on 1 GPU, the 2-GPU run guessed
#                         at twice that (every weight broadcast over gloo)                ~300 s
#   longctx               7 B (Llama-2 shape, 6.74 B) at 64K and 128K tokens per sequence, one sequence a
#                         step, 1 warm-up + 2 measured, sequence_tile_tokens "auto" (the default), checkpoints
#                         on the GPU (what `megatrain estimate --gpu-gib 139 --host-gib 125` places there):
#                         ~30 s and ~70 s a step by the attention FLOPs, fixed ~75 s each   ~450 s
#   longctx-more          the same at 256K with checkpoint_interval=2 (the plan's placement), 1 measured
#                         step (~250 s by the FLOPs); 512K does not fit 139 GiB by the plan (estimate says
#                         so) and would take ~1000 s a step                               ~400 s
#   speed-16k             issue 36's speed options at the baselines-16k workload (3.14 B, 16K tokens/step, ga 1,
#                         8 warm-up + 8 measured), side by side in one invocation: megatrain with its defaults,
#                         megatrain_compile (TrainingArguments(torch_compile=True): its layer templates compiled
#                         by inductor), megatrain_liger (use_liger_kernel=True: Liger's RMSNorm/SwiGLU/rotary in
#                         the layers; needs liger-kernel, e.g. its wheel in .whl/), plain; not measured before:
#                         megatrain ~85 s, +~60-120 s of compile guessed, liger ~85 s, plain ~50 s  ~480 s
#   speed-16k-plain       the same workload, plain Trainer with the same options: plain_compile (whole model
#                         compiled), plain_liger (Liger with its fused linear cross-entropy); not measured
#                         before: ~50 s + compile, ~50 s                                  ~300 s
#   speed-7b              7 B (Llama-2 shape), 8 x 8K (seq 4096 x mb 2 x ga 8), 2 warm-up + 3 measured: megatrain
#                         defaults, megatrain_compile, megatrain_liger (the goal: >= 400 TFLOPS with the speed
#                         options); not measured before: ~120 s each, +~100 s of compile  ~480 s
#   NAME (letters, digits, _) with BENCH_ARGS_NAME set: `megatrain bench $BENCH_ARGS_NAME`, megatrain's
#                         options from CONFIG_NAME (JSON), earlier results in out/NAME merged (--merge)
# The DeepSpeed warm-up is 8 steps at 16K: with 2, its measured steps still got faster
# (d99d99b: 3.21 / 2.60 / 2.59 / 2.46 / 2.42 s; the report flags such a trend). ZenFlow applies a
# full update every 4 steps, hence 8 measured steps (whole cycles). DeepSpeed and FSDP2 at 7 B are
# not run: ZeRO-3's 16 B/param of host state for 6.74 B parameters (108 GB, pinned) leaves no room
# in 125 GiB beside the process.
#
# A plan for 30 device minutes, most wanted first (calls back to back keep the machine warm, so
# only the first pays the start and the CPU Adam compile):
#   call 1: baselines-16k                  (~485 s)
#   call 2: baselines-16k-more             (~410 s)
#   call 3: baselines-4x16k 1.36b          (~475 s)
#   call 4: 7b tests                       (~305 s), if the time left allows
# megatrain runs with its default options in every baselines-*, 1.36b and 7b stage (MEGATRAIN_CONFIG
# is unset for them).
set -u
cd "$(dirname "$0")/.." || exit 2

declare -A ARGS EST
B16="--model llama-3.14b --seq-len 4096 --micro-batch 4 --grad-accum 1 --warmup-steps 8 --steps 8"
B64="--model llama-3.14b --seq-len 4096 --micro-batch 4 --grad-accum 4 --warmup-steps 3 --steps 4"
ARGS[baselines-16k]="$B16 --systems megatrain,deepspeed,deepspeed_zero2,plain --timeout 300"
ARGS[baselines-16k-more]="$B16 --systems deepspeed_offloadpp,deepspeed_zenflow,fsdp2 --timeout 300"
ARGS[baselines-4x16k]="$B64 --systems megatrain,deepspeed,plain --timeout 300"
ARGS[baselines-4x16k-more]="$B64 --systems deepspeed_zero2,deepspeed_offloadpp,fsdp2 --timeout 300"
ARGS[speed-16k]="$B16 --systems megatrain,megatrain_compile,megatrain_liger,plain --timeout 300"
ARGS[speed-16k-plain]="$B16 --systems plain_compile,plain_liger --timeout 280"
ARGS[speed-7b]="--model llama-7b --seq-len 4096 --micro-batch 2 --grad-accum 8 --warmup-steps 2 --steps 3 --systems megatrain,megatrain_compile,megatrain_liger --timeout 300"
ARGS[1.36b]="--model llama-1.36b --seq-len 2048 --micro-batch 8 --grad-accum 4 --warmup-steps 4 --steps 6 --systems megatrain,plain --timeout 200"
# soak: 500 steps at 8K tokens each; every step records host RSS and CUDA memory (flat or not)
ARGS[soak]="--model llama-1.36b --seq-len 4096 --micro-batch 2 --grad-accum 1 --warmup-steps 5 --steps 500 --systems megatrain --timeout 540"
LC="--model llama-7b --micro-batch 1 --grad-accum 1 --systems megatrain"
ARGS[longctx-64k]="$LC --seq-len 65536 --warmup-steps 1 --steps 2 --timeout 280"
ARGS[longctx-128k]="$LC --seq-len 131072 --warmup-steps 1 --steps 2 --timeout 420"
ARGS[longctx-256k]="$LC --seq-len 262144 --warmup-steps 0 --steps 1 --timeout 560"
# Llama-2-70B shape, LoRA r=16 on every linear over an NF4 base, a 24 GiB GPU budget (docs/qlora.md):
# `megatrain estimate --model llama-70b --lora-rank 16 --base-quantization nf4 --seq-len 2048 --grad-accum 2
# --host-gib 125` plans 37.4 GiB of host RAM and 16.8 GiB of GPU (checkpoints on the GPU: 10.3 GiB)
ARGS[qlora-70b]="--model llama-70b --seq-len 2048 --micro-batch 1 --grad-accum 2 --warmup-steps 1 --steps 2 --systems megatrain --lora-rank 16 --base-quantization nf4 --timeout 560"
CONFIG_QLORA='{"max_gpu_memory": "24GiB"}'
ARGS[7b]="--model llama-7b --seq-len 4096 --micro-batch 2 --grad-accum 8 --warmup-steps 3 --steps 4 --systems megatrain --timeout 420"
S3B="--model llama-3.14b --seq-len 4096 --micro-batch 4 --grad-accum 1 --warmup-steps 3 --steps 4 --systems megatrain --timeout 170"
EST=([quality]=150 [state-3b]=270 [grad-3b]=180 [disk-13b-ga1]=330 [tests]=140 [baselines-16k]=485 [baselines-16k-more]=470 [baselines-4x16k]=360 [baselines-4x16k-more]=460
     [speed-16k]=480 [speed-16k-plain]=300 [speed-7b]=480 [1.36b]=115 [7b]=165 [soak]=330 [qlora-70b]=450 [probe]=20 [disk-13b]=350 [dp-7b]=300 [longctx]=450 [longctx-more]=400)
ORDER="quality state-3b grad-3b disk-13b-ga1 tests baselines-16k baselines-16k-more baselines-4x16k baselines-4x16k-more speed-16k speed-16k-plain speed-7b 1.36b 7b soak qlora-70b probe disk-13b dp-7b longctx longctx-more"
D13="--model llama-13b --seq-len 4096 --micro-batch 1 --grad-accum 16"
DP7B="--system megatrain --hidden 4096 --intermediate 11008 --layers 32 --heads 32 --seq 4096 --micro-batch 2 --grad-accum 4 --steps 4"

DRY=${DRY_RUN:-}
[ "$DRY" = 0 ] && DRY=
stages=()
for arg in "$@"; do
  case $arg in
    --dry-run) DRY=1;;
    --list) for s in $ORDER; do echo "$s ~${EST[$s]} s ${ARGS[$s]:-}"; done; exit 0;;
    -*) echo "gpu_suite.sh: unknown option $arg (allowed: --dry-run, --list)" >&2; exit 2;;
    *) stages+=("$arg");;
  esac
done
[ ${#stages[@]} -eq 0 ] && read -r -a stages <<< "${STAGES:-}"
if [ ${#stages[@]} -eq 0 ]; then
  echo "usage: bash scripts/gpu_suite.sh [--dry-run] STAGE... (stages: $ORDER, or NAME with BENCH_ARGS_NAME)" >&2
  exit 2
fi

OUT=${OUT:-/tmp/out}
C=${MEGATRAIN_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
R=/tmp/megatrain_results/$C
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
BUDGET=${BUDGET_S:-585}
DEADLINE=$(( $(date +%s) + BUDGET ))
# left N: N seconds, or what is left of the call less 10 s if that is less (at least 1)
left() { if [ -n "$DRY" ]; then echo "$1"; return; fi
         local l=$(( DEADLINE - $(date +%s) - 10 )); [ "$l" -lt "$1" ] && echo $(( l > 1 ? l : 1 )) || echo "$1"; }
summary() { if [ -n "$DRY" ]; then echo "# $*"; else echo "$*" | tee -a "$R/summary.txt"; fi; }
# run LOG CMD...: the command, its output into LOG; under --dry-run its line instead ("DRY: CMD"),
# quoted so that a shell reads it back
run() { local log=$1; shift
        if [ -n "$DRY" ]; then printf 'DRY:'; printf ' %q' "$@"; printf '\n'; return 0; fi
        "$@" > "$log" 2>&1; }

if [ -z "$DRY" ]; then
  mkdir -p "$R" "$OUT"
  summary "commit $C $(date -u +%FT%TZ) stages: ${stages[*]}"
  { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    python3 -c "import sys,torch,transformers,accelerate;print(sys.version.split()[0],torch.__version__,transformers.__version__,accelerate.__version__)"
    nproc; free -g | head -2; } >> "$R/summary.txt" 2>&1
  # DeepSpeed and its missing dependencies travel as wheels (shared/wheels/README.md); more (TRL) in .whl/
  for w in shared/wheels/py312 .whl; do
    if [ -d "$w" ]; then
      python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$w"/*.whl >> "$R/pip.log" 2>&1 \
        && added=1
    fi
  done
  [ -n "${added:-}" ] && export PYTHONPATH=/tmp/site:$PYTHONPATH
fi

bench_stage() {  # bench_stage STAGE ARGS [MEGATRAIN_CONFIG]: one megatrain bench invocation into $R/STAGE
  local stage=$1 args=$2 config=${3:-} budget
  budget=$(left 575)
  # shellcheck disable=SC2086  # ARGS are words
  if [ -n "$config" ]; then
    run "$R/$stage.log" env MEGATRAIN_CONFIG="$config" timeout $(( budget + 5 )) python3 -m megatrain_hf.cli bench \
      $args --budget-s "$budget" --out "$R/$stage"
  else
    run "$R/$stage.log" env -u MEGATRAIN_CONFIG timeout $(( budget + 5 )) python3 -m megatrain_hf.cli bench \
      $args --budget-s "$budget" --out "$R/$stage"
  fi
  local rc=$?
  [ -n "$DRY" ] && return 0
  summary "$stage rc=$rc $(grep -E '^\| ' "$R/$stage/results.md" 2>/dev/null | head -12 | cut -c1-300)"
  [ -f "$R/$stage/results.json" ] && cp "$R/$stage/results.json" "$OUT/$stage-$C.json"
  # --profile: a text summary of each trace goes in the tarball
  for trace in "$R/$stage"/logs/*.trace.json; do
    [ -f "$trace" ] || continue
    timeout "$(left 60)" python3 scripts/trace_summary.py "$trace" > "$R/$stage-$(basename "$trace" .json.trace.json)-trace.txt" 2>&1
    gzip -1 "$trace"
    # a large trace would not come back from the call (16 MiB a file): its text summary stays
    [ "$(stat -c %s "$trace.gz")" -gt 6000000 ] && rm -f "$trace.gz"
  done
}

for stage in "${stages[@]}"; do
  start=$(date +%s)
  summary "stage $stage (estimate ~${EST[$stage]:-?} s, $(( DEADLINE - start )) s left in the call)"
  case $stage in
    tests)
      [ -z "$DRY" ] && mkdir -p "$R/tests"
      run "$R/tests/gpu_tests.log" env MEGATRAIN_GPU_REPORT="$R/tests/gpu_parity.jsonl" timeout "$(left 420)" \
        python3 -m pytest -m gpu tests/gpu -q -rs ${TESTS_K:+-k "$TESTS_K"}
      rc=$?; [ -z "$DRY" ] && summary "tests rc=$rc $(tail -1 "$R/tests/gpu_tests.log")";;
    probe)
      run "$R/probe.log" timeout "$(left 120)" python3 scripts/host_probe.py
      rc=$?; [ -z "$DRY" ] && summary "probe rc=$rc $(tail -12 "$R/probe.log")";;
    disk-13b)
      D=${DISK_DIR:-/tmp/megatrain-disk}; [ -z "$DRY" ] && mkdir -p "$D"
      run "$R/disk-rates.log" timeout "$(left 150)" python3 scripts/disk_rates.py --dir "$D" --gib 8 --threads 4 8
      [ -z "$DRY" ] && summary "disk rates rc=$? $(tail -4 "$R/disk-rates.log" | tr -d '\n ')"
      # shellcheck disable=SC2086  # D13 are words
      run "$R/disk-13b-estimate.json" python3 -m megatrain_hf.cli estimate $D13 --no-host-staging --optimizer-state 8bit \
        --offload-dir "$D" --json
      layers=40  # under --dry-run the shape's own depth; a real run takes the estimate's, at most the shape's 40
      [ -z "$DRY" ] && layers=$(python3 -c "import json,sys; print(min(40, json.load(open(sys.argv[1]))['disk_tier']['max_layers']))" \
        "$R/disk-13b-estimate.json") && summary "disk-13b: the estimate's largest depth (at most 40): $layers layers"
      bench_stage disk-13b "$D13 --layers $layers --warmup-steps 1 --steps 1 --systems megatrain --timeout 480 --dtype bf16 --device cuda" \
        "{\"offload_dir\": \"$D\", \"host_staging\": false, \"optimizer_state\": \"8bit\", \"offload_state\": \"moments\"}"
      [ -z "$DRY" ] && rm -rf "$D";;
    quality)
      [ -z "$DRY" ] && mkdir -p "$R/quality"
      run "$R/quality/quality.log" timeout "$(left 400)" python3 scripts/optimizer_state_quality.py --device cuda \
        --steps 300 --eval_every 50 --hidden 640 --layers 8 --batch 16 --seq 128 --threads 4 --work "$R/quality" \
        --out "$R/quality/optimizer-state-quality-gpu-$C"
      rc=$?; [ -z "$DRY" ] && summary "quality rc=$rc $(tail -3 "$R/quality/quality.log" | tr '\n' ' ')"
      [ -z "$DRY" ] && cp "$R/quality/optimizer-state-quality-gpu-$C.json" "$OUT/" 2>/dev/null;;
    state-3b)
      for mode in fp32 8bit 4bit; do
        bench_stage "state-3b-$mode" "$S3B --dtype bf16 --device cuda" "{\"optimizer_state\": \"$mode\"}"
      done;;
    grad-3b)
      for gd in fp32 bf16; do
        bench_stage "grad-3b-$gd" "$S3B --dtype bf16 --device cuda" "{\"grad_dtype\": \"$gd\"}"
      done;;
    disk-13b-ga1)
      D=${DISK_DIR:-/tmp/megatrain-disk}; [ -z "$DRY" ] && mkdir -p "$D"
      bench_stage disk-13b-ga1 "--model llama-13b --seq-len 4096 --micro-batch 16 --grad-accum 1 --warmup-steps 1 --steps 1 \
--systems megatrain --timeout 480 --dtype bf16 --device cuda" \
        "{\"offload_dir\": \"$D\", \"grad_dtype\": \"bf16\", \"optimizer_state\": \"8bit\", \"offload_state\": \"moments\"}"
      [ -z "$DRY" ] && rm -rf "$D";;
    dp-7b)
      [ -z "$DRY" ] && mkdir -p "$R/dp-7b"
      for n in 1 2; do
        # shellcheck disable=SC2086  # DP7B are words
        run "$R/dp-7b/gpus$n.log" env -u MEGATRAIN_CONFIG timeout "$(left 280)" torchrun --nproc_per_node "$n" \
          --master_port $(( 29500 + n )) scripts/gpu_train.py $DP7B --out "$R/dp-7b/gpus$n.json"
        rc=$?; [ -z "$DRY" ] && summary "dp-7b gpus=$n rc=$rc $(tail -1 "$R/dp-7b/gpus$n.log" | cut -c1-400)"
        [ -z "$DRY" ] && [ -f "$R/dp-7b/gpus$n.json" ] && cp "$R/dp-7b/gpus$n.json" "$OUT/dp-7b-gpus$n-$C.json"
      done;;
    baselines-16k|baselines-16k-more|baselines-4x16k|baselines-4x16k-more|speed-16k|speed-16k-plain|speed-7b|1.36b|7b|soak)
      bench_stage "$stage" "${ARGS[$stage]} --dtype bf16 --device cuda";;
    qlora-70b)
      bench_stage "$stage" "${ARGS[$stage]} --dtype bf16 --device cuda" "$CONFIG_QLORA";;
    longctx)
      for part in longctx-64k longctx-128k; do
        bench_stage "$part" "${ARGS[$part]} --dtype bf16 --device cuda" '{"sequence_tile_tokens": "auto"}'
      done;;
    longctx-more)
      bench_stage longctx-256k "${ARGS[longctx-256k]} --dtype bf16 --device cuda" \
        '{"sequence_tile_tokens": "auto", "checkpoint_interval": 2}';;
    *)
      var="BENCH_ARGS_${stage}" cfg="CONFIG_${stage}"
      if [[ ! $stage =~ ^[A-Za-z0-9_]+$ ]] || [ -z "${!var:-}" ]; then
        summary "unknown stage $stage (not one of: $ORDER; nor a NAME with BENCH_ARGS_NAME set)"; continue
      fi
      [ -d "out/$stage" ] && [ -z "$DRY" ] && mkdir -p "$R" && cp -r "out/$stage" "$R/$stage"  # earlier results, for --merge
      merge=; [ -d "out/$stage" ] && merge=--merge
      bench_stage "$stage" "${!var} $merge" "${!cfg:-}";;
  esac
  [ -n "$DRY" ] && continue
  summary "stage $stage took $(( $(date +%s) - start )) s"
  tar -czf "$OUT/suite-$C.tar.gz" -C "$R" .  # after every stage: a later timeout keeps what ran
  cp "$R/summary.txt" "$OUT/summary-$C.txt"
done
[ -z "$DRY" ] && cat "$R/summary.txt"
exit 0
