#!/usr/bin/env bash
# The GPU runs that prove the colocated vLLM path (see benchmarks/README.md for their results).
#   bash tests/tools/gpu_checks.sh one OUTDIR [GPU_A GPU_B]  # GPU tests, grpo 1 GPU on GPU_A; bench_rollout and
#                                                        # 1-GPU weight-sync benches on GPU_B (both default 0)
#   bash tests/tools/gpu_checks.sh two OUTDIR [GPUS]         # grpo TP=2 and TP=1 x 2 replicas, 2-GPU sync benches
#   bash tests/tools/gpu_checks.sh placements OUTDIR [GPUS]  # each script's vLLM path in each placement on 2 GPUs:
#                                                        # grpo colocated (every sync checked) and split async, then
#                                                        # ppo colocated (checked) beside dpo --online, 8 steps each
#   bash tests/tools/gpu_checks.sh four OUTDIR [GPUS]        # grpo TP=2 x 2 replicas (FSDP over 4), 4-GPU sync benches
#   bash tests/tools/gpu_checks.sh 7b OUTDIR GPUS TP         # grpo at the 7B shape, FSDP over GPUS, vLLM TP=TP: 10 steps
#                                                        # with every sync checked, device memory sampled each second
#   bash tests/tools/gpu_checks.sh ppo-sync OUTDIR [GPUS]    # ppo.py 20 steps at grpo_1gpu's settings, every sync checked
#                                                        # (GPUS a list such as 0,1: FSDP over them, a replica on each)
#   bash tests/tools/gpu_checks.sh ppo-verl OUTDIR [GPU]     # ppo.py at verl's published PPO shape: 256 prompts of 1024
#                                                        # tokens, 512 new, compiled vLLM; tokens/s end to end, by stage
#   bash tests/tools/gpu_checks.sh ppo OUTDIR [GPU]          # both of those, one after the other (about 10 minutes)
#   bash tests/tools/gpu_checks.sh levels OUTDIR [GPU]       # grpo_1gpu's run at vLLM sleep levels 0, 1, 2, 1 on one
#                                                        # machine (12 steps each): does a level change anything but
#                                                        # the sleep and the sync?
#                                                        # BASELINE=DIR adds an older checkout's grpo.py at level 1
#   bash tests/tools/gpu_checks.sh lora OUTDIR [GPU]         # LoRA: the GPU tests of both --lora-sync ways, then
#                                                        # benchmarks/bench_lora.py at the 7B shape, merged and adapter
#                                                        # (BENCH_FLAGS: e.g. --eager)
#   bash tests/tools/gpu_checks.sh lora-7b OUTDIR [GPU]      # grpo.py --lora-rank 32 at the 7B shape on one GPU, colocated
#                                                        # vLLM, 256 samples of 512-1,024 tokens a step: memory, time
#   bash tests/tools/gpu_checks.sh dpo OUTDIR [GPUS]         # dpo.py offline at the 1.5B shape, pairs of HH-RLHF's lengths:
#                                                        # tokens/s and MFU per step, and the reference log-probs' cost
#                                                        # (SHAPE=7b SCRATCH=/dev/shm ... dpo OUT 0,1: 7B over 2 GPUs)
#   bash tests/tools/gpu_checks.sh long OUTDIR [GPUS]        # grpo.py at the 1.5B shape (LONG_SHAPE), long-tailed responses of mean ~2k
#                                                        # tokens capped at 8,192, 16 prompts x 8, at the defaults: the
#                                                        # planner's start-up choice, tokens/s, MFU, memory, stages;
#                                                        # then --no-activation-checkpointing with 64k-token micro-
#                                                        # batches: the one-line out-of-memory report (RUNS="run"
#                                                        # or "oom": one of them; EXTRA: e.g. --sequence-parallel 2;
#                                                        # LIMIT: seconds for the run, TAG: a suffix for its name)
#   bash tests/tools/gpu_checks.sh train-long OUTDIR [GPUS] [SP]  # bench_train.py at the 7B shape on single sequences
#                                                        # of 8k-64k tokens (LENGTHS), with and without activation
#                                                        # checkpointing (CHECKPOINTING="off on"), full fine-tuning
#                                                        # and LoRA rank 32 (LORA="0 32"),
#                                                        # --sequence-parallel SP (default 1) over GPUS
#   bash tests/tools/gpu_checks.sh hsdp OUTDIR [GPUS]        # grpo at SHAPE (1.5b for issue 41) over GPUS (default 0,1),
#                                                        # 6 steps replicated (--shard-size 1) and sharded (--shard-size
#                                                        # N), every sync checked; then the sharded run's state of step 3
#                                                        # resumed replicated: steps 4-6 beside the uninterrupted run's
#   bash tests/tools/gpu_checks.sh moe OUTDIR [GPUS]         # grpo at a mixture-of-experts shape (MOE_SHAPE, default
#                                                        # olmoe-1b-4b: 3.7B total, 1.3B active; olmoe-1b-7b's full
#                                                        # fine-tuning does not fit one GPU), full fine-tuning,
#                                                        # colocated vLLM, every sync checked, the same seed without
#                                                        # and with --routing-replay (REPLAY="off on", or one of
#                                                        # them, e.g. each on its own GPU): step time, MFU on active
#                                                        # parameters, peak memory, sync time, rollout/logprob_diff
#                                                        # (MOE_SHAPE=qwen3-30b-a3b EXTRA="--lora-rank 32
#                                                        # --activation-checkpointing": the 30B shape with LoRA;
#                                                        # LIMIT: seconds a run, TAG: a suffix for the names)
#   bash tests/tools/gpu_checks.sh preempt OUTDIR [GPUS]     # issue 41's stops and restarts, grpo split over 2 GPUs (one
#                                                        # trains, one generates with vLLM a step ahead): SIGTERM to
#                                                        # every process during an update, then during generation,
#                                                        # each relaunched with the same command; and torchrun
#                                                        # --max-restarts 1 with a trainer killed (SIGKILL) mid-run.
#                                                        # OUTDIR/preempt_summary.txt: PASS/FAIL per case. Five
#                                                        # launches and a restart, each starting vLLM (an estimated
#                                                        # 6-8 minutes in all); CASES runs some of "update generate
#                                                        # kill9" (two calls: CASES="update generate", CASES=kill9)
# Logs and JSON land in OUTDIR. Models are random-weight Qwen2.5 shapes (scripts/random_model.py): SHAPE overrides the
# mode's (0.5b; 1.5b for dpo), and EXTRA holds flags appended to the ppo.py/dpo.py commands (the last of a flag wins);
# together they make a CPU smoke test of those modes' commands and summaries, a few minutes each:
#   SHAPE=tiny EXTRA="--rollout-engine hf --steps 3 --prompts-per-step 4 --max-response-len 8 --eval-size 4" \
#     bash tests/tools/gpu_checks.sh ppo /tmp/smoke
#   SHAPE=tiny EXTRA="--steps 3 --pairs-per-step 8 --eval-size 8" bash tests/tools/gpu_checks.sh dpo /tmp/smoke
#   SHAPE=tiny EXTRA="--rollout-engine hf --prompts-per-step 4 --max-response-len 8 --eval-size 4" \
#     bash tests/tools/gpu_checks.sh preempt /tmp/smoke
set -u
mode=$1; out=$2; mkdir -p "$out"
EXTRA=${EXTRA:-}
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
# A reward with variance in every group (a hash of the completion), so every step updates the weights and
# the sync check compares weights that really changed; lr 1e-4 moves bf16 weights by more than one ulp.
cat > /tmp/hash_reward_$mode.py <<'PY'
import zlib
def reward(prompt, completion, answer):
    return float(zlib.crc32(completion.encode()) % 2)
PY
shape=${SHAPE:-$([ "$mode" = dpo ] && echo 1.5b || echo 0.5b)}
model=/tmp/qwen${shape}_$mode  # one per mode: modes may run side by side on one machine
case $mode in 7b|lora*|long|train-long|moe) ;; *) [ -f $model/tokenizer.json ] || python3 scripts/random_model.py --shape $shape --out $model || exit 1 ;; esac
SMALL="--model $model --reward-fn /tmp/hash_reward_$mode.py:reward --skip-reward-check --lr 1e-4 --steps 20 --eval-every 10
  --max-response-len 128 --prompts-per-step 32 --group-size 8 --eval-size 64 --check-weight-sync --rollout-engine vllm --resume none --overwrite"
GRPO="grpo.py $SMALL"

run() {  # run NAME TIMEOUT GPUS CMD...: one logged step
  local name=$1 limit=$2 gpus=$3; shift 3
  CUDA_VISIBLE_DEVICES=$gpus timeout "$limit" "$@" > "$out/$name.log" 2>&1
  echo "$name rc=$?"; grep -E "step +(0|10|20) \||held-out|Error|error|passed|failed" "$out/$name.log" | tail -n 6 | cut -c1-400
}

count() {  # count GPUS: how many GPUs a list such as 0,1 names
  echo "$1" | tr , '\n' | wc -l
}

sync() {  # sync SHAPE TP GPUS: the weight-sync bench
  local n; n=$(count "$3")
  run sync_$1_${n}gpu_tp$2 150 "$3" torchrun --standalone --nproc_per_node "$n" benchmarks/bench_sync.py --shape "$1" --tp "$2" \
    --out "$out/sync_$1_${n}gpu_tp$2.json"
}

summary() {  # summary NAME RUN_DIR [BASELINE_TOKENS_PER_S]: every row of the run's metrics.jsonl, then the medians
  # of steps 2+ (step 1 warms up); the run's metrics land in OUTDIR, its checkpoints are deleted
  cp "$2/metrics.jsonl" "$out/$1_metrics.jsonl" || return
  python3 - "$2/metrics.jsonl" "${3:-0}" <<'PY' | tee "$out/$1_summary.txt"
import json, statistics, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
baseline = float(sys.argv[2])
shown = {"perf/mfu": "mfu", "perf/peak_memory_gb": "mem_GB", "response/length_mean": "len",
         "loss/preference": "loss", "rewards/chosen": "r_chosen", "rewards/rejected": "r_rejected"}
outside = {"time/step", "time/eval", "time/save", "time/save_state"}  # not stages of the step (eval, saves: after it)
for r in rows:
    head = (f"step {r['step']}: {r['time/step']:.2f} s, {r['perf/tokens_per_s'] * r['time/step']:.0f} tokens, "
            f"{r['perf/tokens_per_s']:.0f} tokens/s" if "time/step" in r else f"step {r['step']} (before training):")
    print(head, " ".join(f"{short}={r[k]:.4g}" for k, short in shown.items() if k in r), "| seconds:",
          " ".join(f"{k[5:]}={v:.2f}" for k, v in r.items() if k.startswith("time/") and k != "time/step"))
if rows and "time/reference" in rows[0]:  # dpo.py --ref-cache: computed once before step 1, in no step's time
    print(f"reference log-probs before step 1: {rows[0]['time/reference']:.2f} s")
measured = [r for r in rows if "time/step" in r and r["step"] >= 2]
if not measured:
    sys.exit("no step after the first finished: nothing to take medians of")
median = lambda key: statistics.median(r.get(key, 0.0) for r in measured)
for r in measured:
    r["tokens"] = r["perf/tokens_per_s"] * r["time/step"]  # prompts + responses (DPO: a pair's prompt twice)
step, tokens_per_s = median("time/step"), median("perf/tokens_per_s")
stages = sorted({k for r in measured for k in r if k.startswith("time/")} - outside)
print(f"median of steps {measured[0]['step']}-{measured[-1]['step']}: {step:.2f} s a step, "
      f"{median('tokens'):.0f} tokens a step, {tokens_per_s:.0f} tokens/s end to end"
      + (f" = {tokens_per_s / baseline:.1f}x the baseline's {baseline:.0f}" if baseline else ""))
print("  stages (s):", " ".join(f"{k[5:]}={median(k):.2f}" for k in stages),
      f"other={step - sum(median(k) for k in stages):.2f}")
if any("perf/mfu" in r for r in measured):
    print(f"  MFU (training FLOPs over the update's time) {median('perf/mfu'):.3f}")
if any("perf/peak_memory_gb" in r for r in measured):
    print(f"  peak GPU memory {max(r.get('perf/peak_memory_gb', 0) for r in rows):.1f} GB")
PY
  rm -rf "$2"
}

if [ "$mode" = one ]; then
  a=${3:-0}; b=${4:-0}
  ( run gpu_tests 240 $a python3 -m pytest -m gpu tests/test_gpu.py tests/test_logprobs.py -q -rs -s -p no:cacheprovider
    run grpo_1gpu 240 $a torchrun --standalone --nproc_per_node 1 $GRPO --rollout-eager --output-dir /tmp/g1_$mode ) &
  ( run bench_rollout 300 $b torchrun --standalone --nproc_per_node 1 benchmarks/bench_rollout.py --out "$out/rollout_0.5b_1gpu.json"
    for s in 0.5b 1.5b 7b; do sync $s 1 $b; done ) &
  wait
elif [ "$mode" = levels ]; then
  # Level 0, level 1, (BASELINE's,) level 2, level 1 again: drift of the machine over the runs shows as a difference
  # between the two level-1 runs. BASELINE: the directory of an older checkout (e.g. `git archive` of the commit before
  # a refactor), whose grpo.py runs with the same flags at its own default level in between. RUNS picks some of them.
  for run_level in ${RUNS:-0 1a ${BASELINE:+base} 2 1b}; do
    if [ $run_level = base ]; then
      cmd="$BASELINE/grpo.py ${SMALL/--skip-reward-check/}"  # flags the older grpo.py lacks are left out
    else
      cmd="$GRPO --rollout-sleep-level ${run_level:0:1}"
    fi
    run grpo_level$run_level 200 ${3:-0} torchrun --standalone --nproc_per_node 1 $cmd --steps 12 --eval-every 0 \
      --rollout-eager --output-dir /tmp/g_level$run_level
    summary grpo_level$run_level /tmp/g_level$run_level | tail -n 2
  done
elif [ "$mode" = two ]; then
  g=${3:-0,1}
  run grpo_2gpu_tp2 300 $g torchrun --standalone --nproc_per_node 2 $GRPO --rollout-eager --rollout-tp 2 --output-dir /tmp/g2_$mode
  run grpo_2gpu_tp1 300 $g torchrun --standalone --nproc_per_node 2 $GRPO --rollout-eager --rollout-tp 1 --output-dir /tmp/g3_$mode
  for s in 0.5b 1.5b 7b; do sync $s 2 $g; done
elif [ "$mode" = placements ]; then
  g=${3:-0,1}; first=${g%%,*}; second=${g##*,}
  SHORT="$SMALL --steps 8 --eval-every 4 --rollout-eager $EXTRA"
  run grpo_colocated 300 $g torchrun --standalone --nproc_per_node 2 grpo.py $SHORT --output-dir /tmp/pl_colocated
  run grpo_split_async 300 $g torchrun --standalone --nproc_per_node 2 grpo.py ${SHORT/--check-weight-sync/} \
    --rollout-ranks 1 --async-rollout --output-dir /tmp/pl_split
  ( run ppo_colocated 300 $first torchrun --standalone --nproc_per_node 1 ppo.py $SHORT --output-dir /tmp/pl_ppo ) &
  ( run dpo_online 300 $second torchrun --standalone --nproc_per_node 1 dpo.py --online ${SHORT/--check-weight-sync/} \
      --output-dir /tmp/pl_dpo ) &
  wait
elif [ "$mode" = four ]; then
  g=${3:-0,1,2,3}
  run grpo_4gpu_tp2 300 $g torchrun --standalone --nproc_per_node 4 $GRPO --rollout-eager --rollout-tp 2 --output-dir /tmp/g4_$mode
  for s in 0.5b 1.5b 7b; do sync $s 2 $g; done
  sync 7b 4 $g
  run gpu_tests_batching 120 ${g%%,*} python3 -m pytest -m gpu tests/test_logprobs.py -q -rs -s -p no:cacheprovider
elif [ "$mode" = 7b ]; then
  g=$3; tp=$4; n=$(count "$g"); name=grpo_7b_${n}gpu_tp$tp
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
# A 7B model whose responses end after about 1,000 tokens (a random model samples about uniformly; bench_lora.py
# generates with ignore_eos), built once per machine.
if [ "$mode" = lora ] || [ "$mode" = lora-7b ]; then
  [ -d /tmp/qwen7b_stop1000 ] || python3 scripts/random_model.py --shape 7b --stop-every 1000 --out /tmp/qwen7b_stop1000 \
    || exit 1
fi
if [ "$mode" = lora ]; then
  run gpu_tests_lora 400 ${3:-0} python3 -m pytest -m gpu tests/test_gpu.py -k lora -q -rs -s -p no:cacheprovider
  for m in merged adapter; do
    run lora_bench_$m 330 ${3:-0} torchrun --standalone --nproc_per_node 1 benchmarks/bench_lora.py \
      --model /tmp/qwen7b_stop1000 --mode $m ${BENCH_FLAGS:-} --out "$out/lora_bench_$m.json"
  done
fi
if [ "$mode" = lora-7b ]; then
  # 32 prompts of 512 tokens x 8 responses of up to 512 (geometric, mean about 400): samples of 512-1,024 tokens.
  python3 scripts/random_data.py prompts --rows 600 --prompt-len 512 --out /tmp/prompts512.jsonl || exit 1
  g=${3:-0}; name=grpo_lora_7b_1gpu
  nvidia-smi -i "$g" --query-gpu=index,memory.used --format=csv,noheader,nounits -l 1 > "$out/${name}_memory.csv" & smi=$!
  run $name 480 $g torchrun --standalone --nproc_per_node 1 grpo.py --model /tmp/qwen7b_stop1000 \
    --dataset /tmp/prompts512.jsonl --reward-fn /tmp/hash_reward_$mode.py:reward --skip-reward-check \
    --lora-rank 32 --lr 1e-4 --prompts-per-step 32 --group-size 8 --max-prompt-len 512 --max-response-len 512 \
    --steps ${STEPS:-3} --eval-every 0 --eval-size 16 --activation-checkpointing --check-weight-sync \
    --rollout-engine vllm --rollout-eager --save-state-every 0 --resume none --overwrite --output-dir /tmp/$name $EXTRA
  kill $smi
  du -sh /tmp/$name/state_* /tmp/$name/hf_step_* | tee "$out/${name}_sizes.txt"
  summary $name /tmp/$name
  echo "$name device memory peak (MiB):" $(sort -t, -k2,2n "$out/${name}_memory.csv" | tail -n 1)
fi
# ppo makes both PPO runs, ppo-sync and ppo-verl one each (each fits in a 10-minute call, the two together may not).
if [ "$mode" = ppo ] || [ "$mode" = ppo-sync ]; then
  g=${3:-0}; n=$(count "$g")  # a list of GPUs: FSDP over them, one vLLM replica on each
  run ppo_sync$([ "$n" = 1 ] || echo _${n}gpu) 300 $g torchrun --standalone --nproc_per_node "$n" ppo.py $SMALL \
    --rollout-eager --output-dir /tmp/p1_$mode $EXTRA
fi
if [ "$mode" = ppo ] || [ "$mode" = ppo-verl ]; then
  # verl's published PPO run (Qwen2.5-0.5B-Instruct, GSM8K, 1 GPU): 256 prompts x about 382 tokens, 66 s a step, about
  # 1.5k tokens/s. Here the same batch with longer sequences: 256 prompts of 1024 tokens, one response each of up to 512
  # (all 512: a random model almost never samples its EOS), 4 mini-batches of 64 prompts as in verl's quickstart, no
  # critic warm-up (verl's critic_warmup 0). Step 1 warms up; before it, vLLM compiles and captures CUDA graphs
  # (2-3 minutes).
  python3 scripts/random_data.py prompts --rows 1296 --prompt-len 1024 --out /tmp/verl_prompts_$mode.jsonl || exit 1
  run ppo_verl 500 ${3:-0} torchrun --standalone --nproc_per_node 1 ppo.py --model $model \
    --dataset /tmp/verl_prompts_$mode.jsonl --reward-fn /tmp/hash_reward_$mode.py:reward --skip-reward-check \
    --prompts-per-step 256 --group-size 1 --max-prompt-len 1024 --max-response-len 512 --num-mini-batches 4 \
    --critic-warmup-steps 0 --steps 5 --eval-every 0 --eval-size 16 --rollout-engine vllm --rollout-gpu-memory 0.3 \
    --save-state-every 0 --resume none --overwrite --output-dir /tmp/ppo_verl_$mode $EXTRA
  summary ppo_verl /tmp/ppo_verl_$mode 1500
fi
if [ "$mode" = dpo ]; then
  # Offline DPO at the 1.5B shape: 128 pairs a step of HH-RLHF's lengths (about 44k tokens), packed into micro-batches
  # of 8k tokens: about 25 GB of activations beside 25 GB of fp32 weights, gradients and Adam state, inside 80 GB
  # without activation checkpointing. The reference log-probs are computed once, before step 1, into a fresh
  # --ref-cache: that cost is step 0's time/reference, in no step's time. The start-up check (loss ln 2 and implicit
  # rewards 0 at step 1, up to 0.05 nats) is skipped, as bf16 sums of a random model's log-probs packed two ways may
  # miss it: step 1's loss and rewards are in the summary.
  python3 scripts/random_data.py pairs --rows 1344 --out /tmp/hh_like_pairs_$mode.jsonl || exit 1
  rm -rf /tmp/dpo_ref_cache_$mode
  g=${3:-0}; n=$(count "$g"); name=dpo_$([ "$n" = 1 ] && echo 1gpu || echo ${shape}_${n}gpu)
  run $name 420 $g torchrun --standalone --nproc_per_node "$n" dpo.py --model $model \
    --dataset /tmp/hh_like_pairs_$mode.jsonl --pairs-per-step 128 --steps 10 --eval-size 64 --eval-every 0 \
    --max-len 1024 --max-tokens-per-micro-batch 8192 --ref-cache /tmp/dpo_ref_cache_$mode --skip-start-check \
    --save-state-every 0 --resume none --overwrite --output-dir "${SCRATCH:-/tmp}/dpo_$mode" $EXTRA
  summary $name "${SCRATCH:-/tmp}/dpo_$mode"
fi
if [ "$mode" = long ]; then
  # The run of issue 37 (a new user's first long-response run): step 1 took 56 s at a 76 GB peak and step 2 died of
  # out-of-memory at the defaults before the planner chose activation checkpointing at start-up.
  ls=${LONG_SHAPE:-1.5b}
  [ -d /tmp/qwen${ls}_stop2000 ] || python3 scripts/random_model.py --shape $ls --stop-every 2000 \
    --out /tmp/qwen${ls}_stop2000 || exit 1
  python3 -c "import sys; sys.path.insert(0, 'benchmarks'); import bench_async; print(bench_async.REWARD)" \
    > /tmp/long_reward.py || exit 1
  g=${3:-0}; n=$(count "$g")
  LONG="grpo.py --model /tmp/qwen${ls}_stop2000 --reward-fn /tmp/long_reward.py:reward --skip-reward-check
    --max-response-len 8192 --prompts-per-step 16 --group-size 8 --eval-every 0 --eval-size 16 --rollout-engine vllm
    --save-state-every 0 --resume none --overwrite"
  if [[ " ${RUNS:-run oom} " == *" run "* ]]; then
    name=grpo_long_${ls}_${n}gpu${TAG:+_$TAG}
    run $name ${LIMIT:-560} $g torchrun --standalone --nproc_per_node "$n" $LONG --steps ${STEPS:-5} --output-dir /tmp/$name $EXTRA
    grep -E "^planner|activation" "$out/$name.log" | cut -c1-300
    summary $name /tmp/$name
  fi
  if [[ " ${RUNS:-run oom} " == *" oom "* ]]; then
    name=grpo_long_oom_${ls}_${n}gpu
    run $name 300 $g torchrun --standalone --nproc_per_node "$n" $LONG --steps 1 --rollout-eager --eval-size 1 \
      --no-activation-checkpointing --max-tokens-per-micro-batch 65536 --output-dir /tmp/$name $EXTRA
    echo "$name: $(grep -c Traceback "$out/$name.log") tracebacks; the lines naming the out-of-memory:"
    grep -i "out of GPU memory\|OutOfMemory" "$out/$name.log" | cut -c1-600
  fi
fi
if [ "$mode" = train-long ]; then
  g=${3:-0}; n=$(count "$g"); sp=${4:-1}
  for lora in ${LORA:-0 32}; do
    for checkpointing in ${CHECKPOINTING:-off on}; do
      ac=$([ "$checkpointing" = on ] && echo --activation-checkpointing)
      name=train_7b_long_${n}gpu_sp${sp}_lora${lora}${ac:+_ac}
      run $name 300 $g torchrun --standalone --nproc_per_node "$n" benchmarks/bench_train.py --shapes 7b --modes packed \
        --num-samples 1 --steps ${STEPS:-2} --lengths ${LENGTHS:-8192 16384 32768 65536} --sequence-parallel "$sp" \
        --lora-rank "$lora" $ac --out "$out/$name.json"
      grep -E "^7b packed" "$out/$name.log" | cut -c1-260
    done
  done
fi
if [ "$mode" = hsdp ]; then
  g=${3:-0,1}; n=$(count "$g")
  for k in 1 $n; do
    run grpo_${shape}_${n}gpu_shard$k 300 $g torchrun --standalone --nproc_per_node "$n" $GRPO --shard-size $k --steps 6 \
      --save-state-every 3 --eval-every 0 --rollout-eager --output-dir /tmp/hsdp_$k $EXTRA
  done
  run grpo_${shape}_${n}gpu_shard${n}_resumed_shard1 300 $g torchrun --standalone --nproc_per_node "$n" $GRPO \
    --shard-size 1 --steps 6 --save-state-every 3 --eval-every 0 --rollout-eager --resume /tmp/hsdp_$n/state_000003 \
    --output-dir /tmp/hsdp_resumed $EXTRA
  python3 - /tmp/hsdp_1 /tmp/hsdp_$n /tmp/hsdp_resumed <<'PY' | tee "$out/hsdp_${shape}_${n}gpu_summary.txt"
import json, statistics, sys
for path in sys.argv[1:]:
    rows = [json.loads(line) for line in open(f"{path}/metrics.jsonl")]
    steps = [r for r in rows if "time/step" in r]
    print(path, "| loss by step:", " ".join(f"{r['step']}:{r.get('loss/policy', float('nan')):.5f}" for r in steps),
          "| reward by step:", " ".join(f"{r['step']}:{r.get('reward/mean', float('nan')):.3f}" for r in steps))
    later = [r for r in steps if r["step"] >= 2]
    if later:
        print(f"  median of steps 2+: {statistics.median(r['time/step'] for r in later):.2f} s a step, update "
              f"{statistics.median(r.get('time/update', 0) for r in later):.2f} s, peak "
              f"{max(r.get('perf/peak_memory_gb', 0) for r in steps):.1f} GB, sync checks "
              f"{sum(1 for r in steps if 'time/check_sync' in r)}")
PY
  for d in 1 $n resumed; do cp /tmp/hsdp_$d/metrics.jsonl "$out/hsdp_${shape}_${n}gpu_$d.jsonl"; done
fi
if [ "$mode" = moe ]; then
  moe=${MOE_SHAPE:-olmoe-1b-4b}; g=${3:-0}; n=$(count "$g")
  [ -d /tmp/$moe ] || python3 scripts/random_model.py --shape $moe --stop-every 500 --out /tmp/$moe || exit 1
  for replay in ${REPLAY:-off on}; do
    name=grpo_${moe}_${n}gpu_replay_$replay${TAG:+_$TAG}
    run $name ${LIMIT:-540} $g torchrun --standalone --nproc_per_node "$n" grpo.py --model /tmp/$moe \
      --reward-fn /tmp/hash_reward_$mode.py:reward --skip-reward-check --lr 1e-5 --steps ${STEPS:-5} --eval-every 0 \
      --eval-size 16 --prompts-per-step 32 --group-size 8 --max-response-len 1024 --precision bf16 --check-weight-sync \
      --logprob-diff-every 1 --rollout-engine vllm --save-state-every 0 --resume none --overwrite \
      --output-dir /tmp/$name $([ $replay = on ] && echo --routing-replay) $EXTRA
    python3 - /tmp/$name/metrics.jsonl <<'PY' | tee "$out/${name}_moe.txt"
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
for key in ("rollout/logprob_diff", "moe/max_load", "moe/router_entropy", "moe/route_agreement", "time/sync",
            "time/check_sync"):
    print(key, [round(r[key], 4) for r in rows if key in r])
PY
    summary $name /tmp/$name
  done
fi
if [ "$mode" = preempt ]; then
  # The stop moments are the fault tests' (tests/test_split.py, tests/test_restarts.py), reached through their
  # environment variables (common/run/signals.py), which work under any torchrun: NANORL_TEST_SIGNAL=update:3 sends
  # SIGTERM to every process of the launch (as Slurm does) when the trainer starts step 3's update; generate:3 when the
  # rollout rank starts generating batch 3 (the trainer then trains batch 2); NANORL_TEST_CRASH=update:3:rank=0:once
  # kills the trainer (SIGKILL, as kill -9) as it starts step 3's update, before torchrun's restart only. States:
  # none before the stop but the stop's own; every 2 steps for the restart, which must resume from state 2.
  g=${3:-0,1}; limit=${LIMIT:-300}
  PREEMPT="grpo.py --model $model --reward-fn /tmp/hash_reward_$mode.py:reward --skip-reward-check --lr 1e-4
    --rollout-engine vllm --rollout-eager --rollout-ranks 1 --async-rollout --max-response-len 128
    --prompts-per-step 16 --group-size 4 --eval-every 0 --eval-size 16"
  launch() {  # launch NAME [VAR=VALUE...] COMMAND...: as run, keeping the exit code in OUTDIR/NAME.rc for the check
    local name=$1; shift
    CUDA_VISIBLE_DEVICES=$g timeout "$limit" env "$@" > "$out/$name.log" 2>&1; echo $? > "$out/$name.rc"
    echo "$name rc=$(cat "$out/$name.rc")"
  }
  for case in ${CASES:-update generate kill9}; do
    dir=/tmp/preempt_$case; rm -rf "$dir"
    if [ "$case" = kill9 ]; then
      launch preempt_kill9 NANORL_TEST_CRASH=update:3:rank=0:once torchrun --standalone --nproc_per_node 2 \
        --max-restarts 1 $PREEMPT --steps 4 --save-state-every 2 --output-dir "$dir" $EXTRA
      python3 tests/tools/preempt_check.py restart preempt_kill9 "$dir" "$out" 4 2 | tee "$out/preempt_${case}_summary.txt"
    else
      launch preempt_${case}_stopped NANORL_TEST_SIGNAL=$case:3 torchrun --standalone --nproc_per_node 2 $PREEMPT \
        --steps 5 --save-state-every 0 --output-dir "$dir" $EXTRA
      python3 tests/tools/preempt_check.py facts "$dir" > "$out/preempt_${case}_stopped.json"
      launch preempt_${case}_resumed torchrun --standalone --nproc_per_node 2 $PREEMPT --steps 5 --save-state-every 0 \
        --output-dir "$dir" $EXTRA
      python3 tests/tools/preempt_check.py stop preempt_$case "$dir" "$out" 5 | tee "$out/preempt_${case}_summary.txt"
    fi
    cp "$dir/metrics.jsonl" "$out/preempt_${case}_metrics.jsonl" 2>/dev/null; rm -rf "$dir"  # states: 6 GB each
  done
  cat "$out"/preempt_*_summary.txt > "$out/preempt_summary.txt"  # with the cases of earlier calls (CASES)
fi
