#!/usr/bin/env bash
# The GPU runs that prove the colocated vLLM path (see benchmarks/README.md for their results).
#   bash scripts/gpu_checks.sh one OUTDIR [GPU_A GPU_B]  # GPU tests, grpo 1 GPU on GPU_A; bench_rollout and
#                                                        # 1-GPU weight-sync benches on GPU_B (both default 0)
#   bash scripts/gpu_checks.sh two OUTDIR [GPUS]         # grpo TP=2 and TP=1 x 2 replicas, 2-GPU sync benches
#   bash scripts/gpu_checks.sh four OUTDIR [GPUS]        # grpo TP=2 x 2 replicas (FSDP over 4), 4-GPU sync benches
#   bash scripts/gpu_checks.sh 7b OUTDIR GPUS TP         # grpo at the 7B shape, FSDP over GPUS, vLLM TP=TP: 10 steps
#                                                        # with every sync checked, device memory sampled each second
# Logs and JSON land in OUTDIR. Models are random-weight Qwen2.5 shapes (scripts/random_model.py).
set -u
mode=$1; out=$2; mkdir -p "$out"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
# A reward with variance in every group (a hash of the completion), so every step updates the weights and
# the sync check compares weights that really changed; lr 1e-4 moves bf16 weights by more than one ulp.
cat > /tmp/hash_reward_$mode.py <<'PY'
import zlib
def reward(prompt, completion, answer):
    return float(zlib.crc32(completion.encode()) % 2)
PY
model=/tmp/qwen0.5b_$mode  # one per mode: modes may run side by side on one machine
[ "$mode" = 7b ] || python3 scripts/random_model.py --shape 0.5b --out $model || exit 1
GRPO="grpo.py --model $model --reward-fn /tmp/hash_reward_$mode.py:reward --skip-reward-check --lr 1e-4 --steps 20 --eval-every 10
  --max-response-len 128 --prompts-per-step 32 --group-size 8 --eval-size 64 --check-weight-sync --rollout-engine vllm --resume none --overwrite"

run() {  # run NAME TIMEOUT GPUS CMD...: one logged step
  local name=$1 limit=$2 gpus=$3; shift 3
  CUDA_VISIBLE_DEVICES=$gpus timeout "$limit" "$@" > "$out/$name.log" 2>&1
  echo "$name rc=$?"; grep -E "step +(0|10|20) \||held-out|Error|error|passed|failed" "$out/$name.log" | tail -n 6 | cut -c1-400
}

sync() {  # sync SHAPE TP GPUS: the weight-sync bench
  local n; n=$(echo "$3" | tr , '\n' | wc -l)
  run sync_$1_${n}gpu_tp$2 150 "$3" torchrun --standalone --nproc_per_node "$n" scripts/bench_sync.py --shape "$1" --tp "$2" \
    --out "$out/sync_$1_${n}gpu_tp$2.json"
}

if [ "$mode" = one ]; then
  a=${3:-0}; b=${4:-0}
  ( run gpu_tests 240 $a python3 -m pytest -m gpu tests/test_gpu.py tests/test_logprobs.py -q -rs -s -p no:cacheprovider
    run grpo_1gpu 240 $a torchrun --standalone --nproc_per_node 1 $GRPO --rollout-eager --output-dir /tmp/g1_$mode ) &
  ( run bench_rollout 300 $b torchrun --standalone --nproc_per_node 1 scripts/bench_rollout.py --out "$out/rollout_0.5b_1gpu.json"
    for s in 0.5b 1.5b 7b; do sync $s 1 $b; done ) &
  wait
elif [ "$mode" = two ]; then
  g=${3:-0,1}
  run grpo_2gpu_tp2 300 $g torchrun --standalone --nproc_per_node 2 $GRPO --rollout-eager --rollout-tp 2 --output-dir /tmp/g2_$mode
  run grpo_2gpu_tp1 300 $g torchrun --standalone --nproc_per_node 2 $GRPO --rollout-eager --rollout-tp 1 --output-dir /tmp/g3_$mode
  for s in 0.5b 1.5b 7b; do sync $s 2 $g; done
elif [ "$mode" = four ]; then
  g=${3:-0,1,2,3}
  run grpo_4gpu_tp2 300 $g torchrun --standalone --nproc_per_node 4 $GRPO --rollout-eager --rollout-tp 2 --output-dir /tmp/g4_$mode
  for s in 0.5b 1.5b 7b; do sync $s 2 $g; done
  sync 7b 4 $g
  run gpu_tests_batching 120 ${g%%,*} python3 -m pytest -m gpu tests/test_logprobs.py -q -rs -s -p no:cacheprovider
elif [ "$mode" = 7b ]; then
  g=$3; tp=$4; n=$(echo "$g" | tr , '\n' | wc -l); name=grpo_7b_${n}gpu_tp$tp
  [ -d /tmp/qwen7b ] || python3 scripts/random_model.py --shape 7b --out /tmp/qwen7b || exit 1
  # nvidia-smi sees vLLM's memory too; PyTorch's own peak is the run's perf/peak_memory_gb
  nvidia-smi -i "$g" --query-gpu=index,memory.used --format=csv,noheader,nounits -l 1 \
    > "$out/${name}_memory.csv" & smi=$!
  run $name 540 $g torchrun --standalone --nproc_per_node "$n" grpo.py --model /tmp/qwen7b \
    --reward-fn /tmp/hash_reward_$mode.py:reward --skip-reward-check --lr 1e-4 --steps 10 --eval-every 0 --eval-size 32 \
    --max-response-len 128 --prompts-per-step 32 --group-size 8 --check-weight-sync --rollout-engine vllm \
    --rollout-eager --rollout-tp "$tp" --resume none --overwrite --output-dir "${SCRATCH:-/tmp}/$name"
  kill $smi; rm -rf "${SCRATCH:-/tmp}/$name"  # the 7B training state is about 90 GB
  echo "$name device memory peak (MiB, per GPU):" $(sort -t, -k1,1n -k2,2n "$out/${name}_memory.csv" | awk -F, '{m[$1]=$2} END {for (i in m) printf "%s:%s ", i, m[i]}')
fi
