#!/usr/bin/env bash
# grpo.py beside verl 0.9.1 on nanorl's long-tailed workload (issue 56): the step-time ratio of the two frameworks on
# the same model, prompts, reward and settings, in one lease. The workload is `tests/tools/gpu_checks.sh long`'s:
# scripts/random_model.py's 1.5B shape with --stop-every 2000 (random weights sample about uniformly, so one token in
# 2,000 ends a response: geometric lengths of mean ~2k, a long tail cut at 8,192), the built-in task's prompts (5
# tokens) in grpo.py's order, 16 prompts x 8 a step, lr 1e-6, no KL, compiled vLLM with CUDA graphs, and
# benchmarks/bench_async.py's reward (a hash of the response checked by math-verify, plus its parity); verl gets the
# same reward's value without math-verify (scripts/peer_long.py, checked against it by tests/test_peer_long.py).
#
#   bash scripts/peer_long.sh [STAGE]       STAGE: prep | nanorl | verl | both | report | all (default)
#
# PAIR picks which mode of each framework runs (each on the GPUs named, grpo.py first):
#   async (default)  grpo.py --partial-rollouts           vs verl trainer.v1.trainer_mode=colocate_async   1 GPU each
#   sync             grpo.py at its defaults (colocated)   vs verl trainer.v1.trainer_mode=sync             1 GPU each
#   split            grpo.py --rollout-ranks 1 --async-rollout vs verl separate_async (1 trainer GPU + 1 vLLM GPU,
#                    NCCL weight sync, which needs cupy on the GPU image)                            2 GPUs each
# verl 0.9.1's async modes belong to its V1 trainer: colocate_async aborts the responses still running once a step's
# groups are complete and continues them after the weight sync, as --partial-rollouts does; separate_async generates
# on GPUs of its own, as split placement does (its older one_step_off_policy recipe is the V0 trainer's).
#
# Stages: prep builds the model (/tmp/peer_long/qwen1.5b_stop2000), the reward file, verl's copy of the model (a
# tokenizer verl can build prompts with: scripts/peer_long.py verl-model), verl's parquet of grpo.py's prompts, and
# checks verl's environment (imports, versions, and that verl gives every prompt grpo.py's token ids); nanorl and
# verl run one framework; both runs them at the same time on their own GPUs (or one after the other where the GPUs
# overlap); report prints the summary; all = prep, both, report.
# Out ($OUT, else /tmp/peer_long_out): PAIR/nanorl.log, nanorl_metrics.jsonl, verl.log, verl_steps.jsonl, mem_*.csv,
# and peer_long.json with both medians (steps 2 on) and the ratio, printed as one line starting with PEERLONG.
#
# On the GPU machine (shared/device/README.md: the bundle in /tmp/site; shared/peers/verl/README.md: verl's parts in
# /tmp/site_verl). Device calls, nvidia-h200-x2, back to back (a machine goes back 30 s after a call ends):
#   here, from the project root, once: bash ../shared/device/make_bundle.sh;
#     bash ../shared/peers/verl/make_verl_bundle.sh; mkdir -p .vb/verl && cp ../shared/peers/verl/* .vb/verl/
#     (the verl kit travels: its verl_log_summary.py parses verl's log)
#   1-8.  carry [".vb/p00"] ... [".vb/p07"]:  bash .vb/p0N/recv.sh                                  (~1 min in all)
#   9.    carry [".vb/v00"]:                  bash .vb/v00/recv_verl.sh
#   10.   carry [".vb/v01", ".vb/verl"]:      bash .vb/v01/recv_verl.sh && bash scripts/peer_long.sh prep  (~2-3 min)
#   11.   carry [".vb/verl"], timeout_s 600:  PAIR=async bash scripts/peer_long.sh both   (GPU 0 grpo.py, GPU 1 verl)
#   12.   carry [".vb/verl"], timeout_s 600:  PAIR=sync bash scripts/peer_long.sh both    (if the lease has time left)
#   (split on the same x2: two calls of 600 s, PAIR=split bash scripts/peer_long.sh nanorl, then PAIR=split ... verl,
#   whose report holds both; check prep's line about cupy first)
# Expected device time: start 1-2 min, parts ~2 min, prep 2-3 min (the 1.5B model drawn on a GPU and saved, 3 GB),
# then up to 10 min a pair (verl's start-up 3-5 min: Ray, TransferQueue, FSDP2, vLLM compiled with CUDA graphs,
# which verl does not cache; grpo.py's ~1.5 min; then 5 steps of ~30-60 s): ~16 min for one pair, ~26 for two.
# A launch still running at LIM seconds is stopped; the steps it finished still count (a median needs step 3).
# Env: PAIR (async), STEPS (5), AC (1: activation checkpointing in both; 0: in neither, grpo.py's planner would
#      leave it off here, verl may then run out of memory), NANORL_GPUS / VERL_GPUS (CUDA_VISIBLE_DEVICES values;
#      default 0 and 1, split 0,1 and 0,1), LIM (560 s a launch), GPU_MEM (0.4: verl's vLLM share of its GPU),
#      WORK (/tmp/peer_long), NANORL_PYTHONPATH (/tmp/site), VERL_PYTHONPATH (/tmp/site_verl:/tmp/site),
#      VERL_KIT (.vb/verl, else ../shared/peers/verl), DRY (1: print verl's composed config and exit; no GPU).
# Extra arguments after STAGE go to verl as Hydra overrides (e.g. actor_rollout_ref.actor.use_torch_compile=False).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
ROOT=$(pwd)
STAGE=${1:-all}; shift $(( $# > 0 ? 1 : 0 ))
PAIR=${PAIR:-async}; STEPS=${STEPS:-5}; AC=${AC:-1}; LIM=${LIM:-560}; GPU_MEM=${GPU_MEM:-0.4}; DRY=${DRY:-0}
WORK=${WORK:-/tmp/peer_long}; OUT=${OUT:-/tmp/peer_long_out}
NANORL_PYTHONPATH=${NANORL_PYTHONPATH:-/tmp/site}; VERL_PYTHONPATH=${VERL_PYTHONPATH:-/tmp/site_verl:/tmp/site}
KIT=${VERL_KIT:-.vb/verl}; [ -f "$KIT/verl_log_summary.py" ] || KIT=../shared/peers/verl
MODEL=$WORK/qwen1.5b_stop2000; VERL_MODEL=$WORK/qwen1.5b_stop2000_verl
DATA=$WORK/verl_data; REWARD=$WORK/long_reward.py
RES=$WORK/$PAIR  # this pair's results, kept on the machine between calls; each stage copies them to $OUT/$PAIR
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false

# What each pair runs: grpo.py's flags and processes, verl's trainer mode and its overrides, the GPUs of each.
case $PAIR in
  sync)  NANORL_FLAGS=(); NPROC=1; VERL_PAIR=(trainer.v1.trainer_mode=sync); GPUS_A=0; GPUS_B=1 ;;
  async) NANORL_FLAGS=(--partial-rollouts); NPROC=1; VERL_PAIR=(trainer.v1.trainer_mode=colocate_async
           trainer.v1.colocate_async.num_warmup_batches=1); GPUS_A=0; GPUS_B=1 ;;
  split) NANORL_FLAGS=(--rollout-ranks 1 --async-rollout); NPROC=2
         VERL_PAIR=(trainer.v1.trainer_mode=separate_async trainer.v1.separate_async.num_warmup_batches=1
           trainer.v1.separate_async.parameter_sync_step=1        # one optimizer step a batch, as grpo.py
           actor_rollout_ref.hybrid_engine=False                   # no vLLM on the trainer's GPU
           actor_rollout_ref.rollout.nnodes=1 actor_rollout_ref.rollout.n_gpus_per_node=1
           actor_rollout_ref.rollout.free_cache_engine=False actor_rollout_ref.rollout.checkpoint_engine.backend=nccl)
         GPUS_A=0,1; GPUS_B=0,1 ;;
  *) echo "PAIR must be async, sync or split, not $PAIR"; exit 1 ;;
esac
NANORL_GPUS=${NANORL_GPUS:-$GPUS_A}; VERL_GPUS=${VERL_GPUS:-$GPUS_B}
[ "$AC" = 1 ] && AC_FLAG=--activation-checkpointing || AC_FLAG=--no-activation-checkpointing
[ "$AC" = 1 ] && VERL_AC=True || VERL_AC=False

# verl's overrides, from ../shared/peers/verl/run_verl_grpo.sh (verl's examples/grpo_trainer), set to grpo.py's
# values for this workload; each differs from verl's default for a reason named beside it or in that script.
VERL_ARGS=(
    algorithm.adv_estimator=grpo
    algorithm.use_kl_in_reward=False
    algorithm.norm_adv_by_std_in_grpo=True                    # grpo.py's --scale-rewards
    data.train_files="$DATA/train.parquet"
    data.val_files="$DATA/val.parquet"
    data.train_batch_size=16                                  # prompts per step
    data.max_prompt_length=256                                # grpo.py's --max-prompt-len
    data.max_response_length=8192
    data.filter_overlong_prompts=False                        # every prompt is 5 tokens (peer_long.py verl-data)
    data.truncation=error
    data.shuffle=False                                        # grpo.py's order, as verl-data wrote it
    actor_rollout_ref.model.path="$VERL_MODEL"
    actor_rollout_ref.model.use_remove_padding=True           # packed sequences, as grpo.py
    actor_rollout_ref.model.enable_gradient_checkpointing="$VERL_AC"
    +actor_rollout_ref.model.override_config.attn_implementation=sdpa  # no flash-attn wheel for torch 2.11 + CUDA 13
    actor_rollout_ref.actor.strategy=fsdp2
    actor_rollout_ref.actor.optim.lr=1e-6                     # grpo.py's default for a model of this size
    actor_rollout_ref.actor.optim.lr_scheduler_type=constant  # no warmup (lr_warmup_steps -1, ratio 0), as grpo.py
    actor_rollout_ref.actor.optim.weight_decay=0.0
    "actor_rollout_ref.actor.optim.betas=[0.9,0.99]"          # grpo.py's --adam-beta2 0.99
    actor_rollout_ref.actor.ppo_mini_batch_size=16            # the whole batch: one optimizer step a step
    actor_rollout_ref.actor.ppo_epochs=1
    actor_rollout_ref.actor.use_dynamic_bsz=True
    actor_rollout_ref.actor.ppo_max_token_len_per_gpu=16384   # grpo.py's --max-tokens-per-micro-batch
    actor_rollout_ref.actor.use_kl_loss=False
    actor_rollout_ref.actor.kl_loss_coef=0.0
    actor_rollout_ref.actor.entropy_coeff=0
    actor_rollout_ref.actor.clip_ratio_low=0.2
    actor_rollout_ref.actor.clip_ratio_high=0.28              # grpo.py's --clip-high
    actor_rollout_ref.actor.loss_agg_mode=token-mean          # grpo.py's --loss-agg all-token-mean
    actor_rollout_ref.actor.fsdp_config.param_offload=False
    actor_rollout_ref.actor.fsdp_config.optimizer_offload=False
    actor_rollout_ref.rollout.name=vllm
    actor_rollout_ref.rollout.tensor_model_parallel_size=1
    actor_rollout_ref.rollout.gpu_memory_utilization="$GPU_MEM"
    actor_rollout_ref.rollout.n=8                             # group size
    actor_rollout_ref.rollout.temperature=1.0
    actor_rollout_ref.rollout.top_p=1.0
    actor_rollout_ref.rollout.enforce_eager=False             # compiled, CUDA graphs: as grpo.py's timed runs
    actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True
    actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=16384
    reward.custom_reward_function.path="$ROOT/scripts/peer_long.py"
    reward.custom_reward_function.name=compute_score
    trainer.critic_warmup=0
    trainer.logger='["console"]'
    trainer.project_name=nanorl_peer
    trainer.experiment_name="verl_long_$PAIR"
    trainer.n_gpus_per_node=1
    trainer.nnodes=1
    trainer.total_epochs=1
    trainer.total_training_steps="$STEPS"
    trainer.save_freq=-1
    trainer.test_freq=-1                                      # no validation (grpo.py: --eval-every 0)
    trainer.val_before_train=False
    trainer.resume_mode=disable
    trainer.default_local_dir="$WORK/verl_ckpt"
    ray_kwargs.ray_init.runtime_env.py_executable=null
    ray_kwargs.ray_init.num_cpus="$(( $(nproc) < 16 ? 16 : $(nproc) ))"  # verl reserves 12 logical CPUs
    +ray_kwargs.ray_init.include_dashboard=False              # Ray is carried without its dashboard extras
    hydra.run.dir="$WORK/verl_hydra"                          # Hydra's outputs/ stays out of the repository
    "${VERL_PAIR[@]}" "$@"
)
NANORL_ARGS=(grpo.py --model "$MODEL" --reward-fn "$REWARD:reward" --skip-reward-check --max-response-len 8192
    --prompts-per-step 16 --group-size 8 --eval-every 0 --eval-size 16 --rollout-engine vllm --save-state-every 0
    --resume none --overwrite --steps "$STEPS" --output-dir "$RES/nanorl_run" "$AC_FLAG" "${NANORL_FLAGS[@]}")

to_out() {  # the pair's results (not the runs' checkpoints) into $OUT, which the device tool brings back
    mkdir -p "$OUT/$PAIR" && find "$RES" -maxdepth 1 -type f -exec cp {} "$OUT/$PAIR/" \;
}

prep() {
    mkdir -p "$WORK" "$RES" "$OUT"
    echo "== prep: model, reward, verl's model and data ($(date +%T))"
    [ -f "$MODEL/config.json" ] || PYTHONPATH=$NANORL_PYTHONPATH python3 scripts/random_model.py --shape 1.5b \
        --stop-every 2000 --out "$MODEL" || return 1
    PYTHONPATH=$NANORL_PYTHONPATH python3 -c "import sys; sys.path.insert(0, 'benchmarks'); import bench_async
print(bench_async.REWARD)" > "$REWARD" || return 1
    PYTHONPATH=$NANORL_PYTHONPATH python3 scripts/peer_long.py verl-data "$MODEL" "$DATA" \
        --batches $(( STEPS + 20 > 100 ? STEPS + 20 : 100 )) || return 1  # more than any run here takes
    # verl's tokenizer is saved by the transformers verl runs with (5.9), which loads it back
    PYTHONPATH=$VERL_PYTHONPATH python3 scripts/peer_long.py verl-model "$MODEL" "$VERL_MODEL" || return 1
    echo "== prep: verl's environment"
    nvidia-smi --query-gpu=index,name,memory.total,memory.used --format=csv,noheader
    PYTHONPATH=$VERL_PYTHONPATH python3 - <<'EOF' || return 1
import importlib.metadata as md
want = {"verl": "0.9.1", "vllm": "0.26.0", "transformers": "5.9.0", "tokenizers": "0.22.2", "trl": "0.27.0",
        "ray": "2.55.1", "tensordict": "0.10.0", "transferqueue": "0.1.11", "antlr4-python3-runtime": "4.9.3"}
def version(package):
    try:
        return md.version(package)
    except md.PackageNotFoundError:
        return "missing"
print(" ".join(f"{p}={version(p)}" for p in ["torch", *want]))
off = [f"{p} {version(p)} (planned {v})" for p, v in want.items() if version(p) != v]
print("PREFLIGHT WARNING, not the planned versions: " + ", ".join(off) if off else "versions as planned")
import torch, transfer_queue, ray, vllm.v1.engine.async_llm, verl.trainer.main_ppo, verl.trainer.ppo.v1  # noqa
assert torch.cuda.is_available(), "no GPU visible"
try:  # separate_async's NCCL weight sync (PAIR=split) needs cupy, from the GPU image
    import cupy, cupy.cuda.nccl  # noqa
    print("cupy", cupy.__version__)
except ImportError as e:
    print(f"no cupy ({e}): PAIR=split cannot run here; async and sync can")
print("PREFLIGHT ok")
EOF
    PYTHONPATH=$VERL_PYTHONPATH python3 scripts/peer_long.py check-verl "$VERL_MODEL" "$DATA" || return 1
    echo "== prep done ($(date +%T)): next, PAIR=$PAIR bash scripts/peer_long.sh both"
}

prepared() {  # a fresh machine (the device tool's go back when idle) has none of prep's files
    if ! [ -f "$MODEL/config.json" ] || ! [ -f "$VERL_MODEL/tokenizer_config.json" ] || ! [ -f "$DATA/train.parquet" ]
    then
        echo "no $MODEL, $VERL_MODEL or $DATA on this machine: run bash scripts/peer_long.sh prep first"
        return 1
    fi
}

run_nanorl() {
    mkdir -p "$RES"
    prepared || return 1
    echo "== nanorl ($PAIR) on GPU $NANORL_GPUS: torchrun --nproc_per_node $NPROC ${NANORL_ARGS[*]}"
    nvidia-smi --query-gpu=index,memory.used --format=csv,noheader,nounits -i "$NANORL_GPUS" -l 1 \
        > "$RES/mem_nanorl.csv" 2>/dev/null & local smi=$!
    CUDA_VISIBLE_DEVICES=$NANORL_GPUS PYTHONPATH=$NANORL_PYTHONPATH timeout -k 20 "$LIM" \
        torchrun --standalone --nproc_per_node "$NPROC" "${NANORL_ARGS[@]}" > "$RES/nanorl.log" 2>&1
    local rc=$?
    kill $smi 2>/dev/null
    echo "nanorl rc=$rc (124: stopped at LIM=${LIM}s)"
    cp "$RES/nanorl_run/metrics.jsonl" "$RES/nanorl_metrics.jsonl" 2>/dev/null
    rm -rf "$RES"/nanorl_run/state_* "$RES"/nanorl_run/hf_step_*  # the run's saves: GBs nobody reads here
    grep -E "^planner|Traceback|Error|out of GPU memory" "$RES/nanorl.log" | head -n 8 | cut -c1-300
    return "$rc"
}

run_verl() {
    mkdir -p "$RES"
    if [ "$DRY" = 1 ]; then
        PYTHONPATH=$VERL_PYTHONPATH python3 -m verl.trainer.main_ppo --cfg job "${VERL_ARGS[@]}"
        return $?
    fi
    prepared || return 1
    local log=$RES/verl.log start rc
    echo "== verl ($PAIR) on GPU $VERL_GPUS: python3 -m verl.trainer.main_ppo ${VERL_ARGS[*]}" | tee "$log"
    nvidia-smi --query-gpu=index,memory.used --format=csv,noheader,nounits -i "$VERL_GPUS" -l 1 \
        > "$RES/mem_verl.csv" 2>/dev/null & local smi=$!
    start=$(date +%s.%N)
    # The kit's environment (run_verl_grpo.sh): a fresh local Ray without its dashboard or OOM killer (which reads a
    # MemTotal that grows with use on these machines); each line stamped with the seconds since launch.
    (unset RAY_ADDRESS; CUDA_VISIBLE_DEVICES=$VERL_GPUS PYTHONPATH=$VERL_PYTHONPATH HYDRA_FULL_ERROR=1 \
        RAY_DEDUP_LOGS=0 TRL_EXPERIMENTAL_SILENCE=1 RAY_memory_monitor_refresh_ms=0 \
        timeout -k 20 "$LIM" python3 -m verl.trainer.main_ppo "${VERL_ARGS[@]}") 2>&1 \
        | python3 -u -c 'import sys, time
t0 = float(sys.argv[1])
for line in sys.stdin:
    sys.stdout.write(f"[{time.time() - t0:7.1f}s] {line}"); sys.stdout.flush()' "$start" >> "$log"
    rc=${PIPESTATUS[0]}
    kill $smi 2>/dev/null
    echo "verl rc=$rc (124: stopped at LIM=${LIM}s)" | tee -a "$log"
    PYTHONPATH=$VERL_PYTHONPATH python3 -m ray.scripts.scripts stop --force > /dev/null 2>&1
    python3 "$KIT/verl_log_summary.py" "$log" "$RES/verl_steps.jsonl" | tee "$RES/verl_summary.txt"
    [ "$rc" = 0 ] || grep -n -m 12 -E "Error|Traceback|OutOfMemory|Killed|RayTaskError" "$log" | cut -c1-300
    if [ "$(stat -c %s "$log")" -gt 15000000 ]; then  # the device tool brings back files of up to 16 MiB
        { head -c 5000000 "$log"; echo "[... cut ...]"; tail -c 9000000 "$log"; } > "$log.cut" && mv "$log.cut" "$log"
    fi
    return "$rc"
}

both() {  # at the same time where the two sets of GPUs differ, else one after the other; fails if either did
    local nanorl_rc verl_rc
    if comm -12 <(tr , '\n' <<< "$NANORL_GPUS" | sort) <(tr , '\n' <<< "$VERL_GPUS" | sort) | grep -q .; then
        run_nanorl; nanorl_rc=$?
        run_verl; verl_rc=$?
    else
        run_nanorl & local nanorl=$!
        run_verl; verl_rc=$?
        wait $nanorl; nanorl_rc=$?
    fi
    [ "$nanorl_rc" = 0 ] && return "$verl_rc" || return "$nanorl_rc"
}

report() {
    mkdir -p "$RES"
    local gpu; gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1)
    printf '{"pair": "%s", "steps": %s, "activation_checkpointing": %s, "nanorl_gpus": "%s", "verl_gpus": "%s", ' \
        "$PAIR" "$STEPS" "$([ "$AC" = 1 ] && echo true || echo false)" "$NANORL_GPUS" "$VERL_GPUS" > "$RES/setup.json"
    printf '"gpu": "%s"}\n' "$gpu" >> "$RES/setup.json"
    python3 scripts/peer_long.py summary "$RES" "$RES/peer_long.json"
}

# The exit status is the runs' (a launch stopped at LIM: 124), not the report's, which runs whatever they did.
case $STAGE in
  prep) prep; rc=$? ;;
  nanorl) run_nanorl; rc=$?; report ;;
  verl) run_verl; rc=$?; [ "$DRY" = 1 ] && exit $rc; report ;;
  both) both; rc=$?; report ;;
  report) report; rc=$? ;;
  all) prep && both; rc=$?; report ;;
  *) echo "STAGE must be prep, nanorl, verl, both, report or all, not $STAGE"; exit 1 ;;
esac
to_out
exit $rc
