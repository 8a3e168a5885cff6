#!/usr/bin/env bash
# The real-model recipes: SmolLM2-135M-Instruct (../shared/models/README.md makes it) on the data in ../shared/data,
# one GPU each unless NPROC says otherwise. benchmarks/README.md records what each gave.
#
#   bash scripts/smollm2_runs.sh RECIPE OUT [extra flags for the script]
#   NPROC=2 bash scripts/smollm2_runs.sh grpo-addition OUT                     # 2 GPUs, colocated: both train and
#                                                                              # generate, each half the prompts
#   NPROC=2 bash scripts/smollm2_runs.sh grpo-addition OUT --rollout-ranks 1 --async-rollout
#                                                                              # 2 GPUs, split: one trains, one
#                                                                              # generates one step ahead
#
#   grpo-addition      grpo.py, 32 prompts x 8, lr 1e-5, 30 steps               (held-out greedy accuracy)
#   grpo-gsm8k         grpo.py on GSM8K with a prompt template asking for "#### N"
#   ppo-addition       ppo.py, 64 prompts x 4 (256 responses a step), lr 1e-5, 60 steps
#   dpo-online         dpo.py --online, 32 prompts x 8, best against worst, lr 3e-6, --sft-weight 1, 60 steps
#   dpo-hh             dpo.py on HH-RLHF harmlessness: the first 2,000 pairs, the last 312 held out, one epoch
#   ablate-grpo        scripts/ablate.py: grpo-addition with the defaults before 2026-11-24 (bf16, token-mean, 5
#                      warmup steps) and one change each (the loss normaliser, Adam's beta2, TIS, no warmup, no
#                      gradient clipping, fp32), seeds 1 and 2, all at once on one GPU
#   lora-grpo          scripts/ablate.py: grpo-addition with full fine-tuning (lr 1e-5) and with LoRA rank 32 at lr
#                      1e-4 and 3e-4 (VARIANTS, default "full lora-1e-4 lora-3e-4"; lora-LR for another lr), seeds 1
#                      and 2 (SEEDS), PARALLEL at once on one GPU, all in micro-batches of 8k tokens (the same update
#                      as 16k's in about half the memory, so that more runs share a GPU)
#   async-curves       scripts/ablate.py: grpo-addition (TASK=gsm8k: grpo-gsm8k) synchronous, with --partial-rollouts,
#                      and fully async (split placement, --async-rollout --partial-rollouts: in-flight updates, 2
#                      GPUs), --max-staleness 2, seeds 1 and 2 (SEEDS), all at once on GPUS (default 0,1); then
#                      OUT/curves.png, the held-out accuracy of every run against the step
#   lora-dpo-hh        dpo-hh with LoRA rank 32 (lr 5e-5, 10x dpo-hh's); dpo-hh itself is the full fine-tuning run
#   calculator-warmup  dpo.py on scripts/make_multiplication.py's pairs (a calculator call over a wrong direct answer,
#                      1,024 pairs, 64 held out, one epoch, --sft-weight 1): SmolLM2 never calls a tool by itself
#   grpo-calculator    grpo.py --tools calculator on 3-digit x 2-digit multiplication, 32 prompts x 8 episodes of up to
#                      3 turns, lr 1e-5, 40 steps; MODEL=<calculator-warmup's OUT>/hf_step_30
#   grpo-calculator-none  the same questions and settings without the tool (the baseline, from SmolLM2 itself)
#   bench-episodes     benchmarks/bench_episodes.py: multi-turn rollouts (4 turns of 128 tokens) against single-turn ones
#                      (512 tokens), generated tokens per second
#   vs-trl-grpo        benchmarks/bench_vs_trl.py grpo: ours and TRL's GRPOTrainer (GPUs: $GPUS, default 0)
#   vs-trl-dpo         benchmarks/bench_vs_trl.py dpo: ours and TRL's DPOTrainer on the dpo-hh settings
#   vs-trl-kto         benchmarks/bench_vs_trl.py kto: ours (dpo.py --loss-type kto) and TRL's KTOTrainer on the dpo-hh
#                      data and settings, each pair a desirable and an undesirable row (32 rows a step, one epoch)
#
# At the scripts' defaults SmolLM2 trains in fp32 on both sides (--precision auto: under 0.3B parameters; dpo-hh, offline,
# stays bf16); append --precision bf16 for the bf16 runs of benchmarks/README.md's earlier rows.
# MODEL (default /tmp/smollm2) and DATA (default ../shared/data) say where the model and the data are; PORT
# (default 29500) is torchrun's port, to run two recipes at once; NPROC (default 1) is the number of GPUs (processes).
set -euo pipefail
cd "$(dirname "$0")/.."
recipe=${1:?recipe}; out=${2:?output directory}; shift 2
model=${MODEL:-/tmp/smollm2}; data=${DATA:-../shared/data}
addition=(--model "$model" --dataset "$data/addition/train.jsonl" --prompt-key question --answer-key answer
          --reward-fn gsm8k --eval-size 128 --max-response-len 512 --eval-every 10)
gsm8k_template="{prompt}
Let's think step by step and output the final answer after \"####\"."
gsm8k=(--model "$model" --dataset "$data/gsm8k/train.jsonl" --prompt-key question --answer-key answer --reward-fn gsm8k
       --eval-size 128 --prompt-template "$gsm8k_template" --max-response-len 512)
hh="$data/hh-rlhf/harmless-base-test.jsonl.gz"
multiplication=(--model "$model" --dataset /tmp/multiplication.jsonl --prompt-key question --answer-key answer
                --reward-fn gsm8k --eval-size 128 --max-response-len 256 --eval-every 10 --prompts-per-step 32
                --group-size 8 --lr 1e-5 --steps 40)
run=(torchrun --nproc_per_node "${NPROC:-1}" --master-port "${PORT:-29500}")
case $recipe in
  grpo-addition) exec "${run[@]}" grpo.py "${addition[@]}" --prompts-per-step 32 --group-size 8 \
                   --lr 1e-5 --steps 30 --output-dir "$out" "$@" ;;
  grpo-gsm8k) exec "${run[@]}" grpo.py "${gsm8k[@]}" --prompts-per-step 32 --group-size 8 \
                   --lr 1e-5 --steps 30 --eval-every 10 --output-dir "$out" "$@" ;;
  ppo-addition) exec "${run[@]}" ppo.py "${addition[@]}" --prompts-per-step 64 --group-size 4 \
                   --lr 1e-5 --steps 60 --output-dir "$out" "$@" ;;
  dpo-online) exec "${run[@]}" dpo.py --online "${addition[@]}" --prompts-per-step 32 --group-size 8 \
                   --lr 3e-6 --sft-weight 1.0 --steps 60 --output-dir "$out" "$@" ;;
  dpo-hh) exec "${run[@]}" dpo.py --model "$model" --dataset "$hh" --eval-size 312 --lr 5e-6 \
                   --beta 0.1 --pairs-per-step 32 --max-len 1024 --eval-every 10 --output-dir "$out" "$@" ;;
  ablate-grpo) exec python scripts/ablate.py --out "$out" --seeds 1 2 --parallel "${PARALLEL:-14}" --base \
                   "grpo.py $(printf '%q ' "${addition[@]}") --prompts-per-step 32 --group-size 8 --lr 1e-5 \
                   --steps 30 --rollout-gpu-memory 4 --rollout-eager --precision bf16 --loss-agg token-mean \
                   --warmup-steps 5" --variant base= \
                   --variant all-token-mean="--loss-agg all-token-mean" --variant adam-beta2-0.999="--adam-beta2 0.999" \
                   --variant tis-cap-3="--tis-cap 3" --variant warmup-0="--warmup-steps 0" \
                   --variant no-grad-clip="--max-grad-norm 1e9" --variant fp32="--precision fp32" "$@" ;;
  lora-grpo) variants=()
             for v in ${VARIANTS:-full lora-1e-4 lora-3e-4}; do  # full: --lr 1e-5; lora-LR: rank 32 at lr LR
               if [ "$v" = full ]; then variants+=(--variant "full=--lr 1e-5")
               else variants+=(--variant "$v=--lora-rank 32 --lr ${v#lora-}"); fi
             done
             exec python scripts/ablate.py --out "$out" --seeds ${SEEDS:-1 2} --parallel "${PARALLEL:-6}" --base \
                   "grpo.py $(printf '%q ' "${addition[@]}") --prompts-per-step 32 --group-size 8 --steps 30 \
                   --rollout-gpu-memory 4 --rollout-eager --max-tokens-per-micro-batch 8192" "${variants[@]}" "$@" ;;
  async-curves) task=("${addition[@]}"); [ "${TASK:-addition}" = gsm8k ] && task=("${gsm8k[@]}")
                base=$(python3 -c 'import shlex, sys; print(shlex.join(sys.argv[1:]))' grpo.py "${task[@]}" \
                   --prompts-per-step 32 --group-size 8 --lr 1e-5 --steps 30 --eval-every 5 --rollout-gpu-memory 4 \
                   --rollout-eager)
                python scripts/ablate.py --out "$out" --seeds ${SEEDS:-1 2} --parallel "${PARALLEL:-6}" \
                   --gpus "${GPUS:-0,1}" --base "$base" --variant sync= \
                   --variant partial="--partial-rollouts --max-staleness 2" \
                   --variant async="--rollout-ranks 1 --async-rollout --partial-rollouts --max-staleness 2" \
                   --nproc async=2 "$@"
                runs=(); for d in "$out"/*_s[0-9]*; do [ -d "$d" ] && runs+=("$d"); done
                exec python scripts/plot.py "${runs[@]}" --metrics eval/accuracy reward/mean --out "$out/curves.png" ;;
  lora-dpo-hh) exec "${run[@]}" dpo.py --model "$model" --dataset "$hh" --eval-size 312 --lr 5e-5 --lora-rank 32 \
                   --beta 0.1 --pairs-per-step 32 --max-len 1024 --eval-every 10 --output-dir "$out" "$@" ;;
  calculator-warmup) python scripts/make_multiplication.py pairs --rows 1024 --out /tmp/calculator_pairs.jsonl
                   exec "${run[@]}" dpo.py --model "$model" --dataset /tmp/calculator_pairs.jsonl --eval-size 64 \
                   --sft-weight 1.0 --lr 5e-6 --pairs-per-step 32 --output-dir "$out" "$@" ;;
  grpo-calculator) python scripts/make_multiplication.py questions --out /tmp/multiplication.jsonl
                   exec "${run[@]}" grpo.py "${multiplication[@]}" --tools calculator --max-turns 3 \
                   --output-dir "$out" "$@" ;;
  grpo-calculator-none) python scripts/make_multiplication.py questions --out /tmp/multiplication.jsonl
                   exec "${run[@]}" grpo.py "${multiplication[@]}" --output-dir "$out" "$@" ;;
  bench-episodes) exec "${run[@]}" benchmarks/bench_episodes.py --model "$model" --out "$out" "$@" ;;
  vs-trl-grpo) exec python benchmarks/bench_vs_trl.py grpo --model "$model" --data "$data/addition/train.jsonl" \
                   --gpus "${GPUS:-0}" --out "$out" "$@" ;;
  vs-trl-dpo)    exec python benchmarks/bench_vs_trl.py dpo --model "$model" --data "$hh" --gpus "${GPUS:-0}" \
                   --out "$out" "$@" ;;
  vs-trl-kto)    exec python benchmarks/bench_vs_trl.py kto --model "$model" --data "$hh" --gpus "${GPUS:-0}" \
                   --out "$out" "$@" ;;
  *) echo "error: unknown recipe $recipe (see the list at the top of $0)" >&2; exit 2 ;;
esac
