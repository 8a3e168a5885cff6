#!/usr/bin/env bash
# The GPU runs that prove the colocated vLLM path (see benchmarks/README.md for their results).
#   bash scripts/gpu_checks.sh one OUTDIR   # 1-GPU checks; with 2 GPUs visible, two streams run side by side
#   bash scripts/gpu_checks.sh two OUTDIR   # 2-GPU checks: TP=2, TP=1 x 2 replicas, weight-sync bench
# Logs and JSON land in OUTDIR. Models are random-weight Qwen2.5 shapes (scripts/random_model.py).
set -u
mode=$1; out=$2; mkdir -p "$out"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
# A reward with variance in every group (a hash of the completion), so every step updates the weights and
# the sync check compares weights that really changed; lr 1e-4 moves bf16 weights by more than one ulp.
cat > /tmp/hash_reward.py <<'PY'
import zlib
def reward(prompt, completion, answer):
    return float(zlib.crc32(completion.encode()) % 2)
PY
python3 scripts/random_model.py --shape 0.5b --out /tmp/qwen0.5b || exit 1
GRPO="grpo.py --model /tmp/qwen0.5b --reward-fn /tmp/hash_reward.py:reward --lr 1e-4 --steps 20 --eval-every 10
  --max-response-len 128 --prompts-per-step 32 --group-size 8 --eval-size 64 --check-weight-sync --rollout-engine vllm --resume none"

run() {  # run NAME TIMEOUT GPUS CMD...: one logged step
  local name=$1 limit=$2 gpus=$3; shift 3
  CUDA_VISIBLE_DEVICES=$gpus timeout "$limit" "$@" > "$out/$name.log" 2>&1
  echo "$name rc=$?"; grep -E "step +(0|10|20) \||held-out|Error|error|passed|failed" "$out/$name.log" | tail -n 6 | cut -c1-400
}

if [ "$mode" = one ]; then
  second=0; [ "$(nvidia-smi -L | wc -l)" -ge 2 ] && second=1
  ( run gpu_tests 300 0 python3 -m pytest -m gpu tests/test_gpu.py tests/test_batching.py -q -rs -p no:cacheprovider
    run grpo_1gpu 300 0 torchrun --standalone --nproc_per_node 1 $GRPO --rollout-eager --output-dir /tmp/g1 ) &
  ( run bench_rollout 420 $second torchrun --standalone --nproc_per_node 1 scripts/bench_rollout.py --out "$out/rollout_0.5b_1gpu.json"
    for s in 0.5b 1.5b; do run sync_$s 150 $second torchrun --standalone --nproc_per_node 1 scripts/bench_sync.py --shape $s --tp 1 --out "$out/sync_${s}_1gpu_tp1.json"; done ) &
  wait
elif [ "$mode" = two ]; then
  run grpo_2gpu_tp2 240 0,1 torchrun --standalone --nproc_per_node 2 $GRPO --rollout-eager --rollout-tp 2 --output-dir /tmp/g2
  run grpo_2gpu_tp1 240 0,1 torchrun --standalone --nproc_per_node 2 $GRPO --rollout-eager --rollout-tp 1 --output-dir /tmp/g3
  run sync_7b_2gpu 150 0,1 torchrun --standalone --nproc_per_node 2 scripts/bench_sync.py --shape 7b --tp 2 --out "$out/sync_7b_2gpu_tp2.json"
fi
