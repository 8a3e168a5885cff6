"""The capacity planner (common/run/planner.py) applied to this run at start-up: a script's flags as the planner's
Setup, an unset --activation-checkpointing decided, the forecast to print, and what running out of GPU memory says,
in a stage of the loop (common/run/logger.py) or at start-up (registered with common/run/errors.py).
"""

from dataclasses import replace

import torch

from common.run import errors
from common.run.cli import given_on_command_line
from common.run.gpus import GPUS
from common.run.planner import GB, HEADROOM, Setup, Shape, describe, fixes, memory, within_headroom

_plan = None  # (shape, setup) of this run, once plan_run has made it


def setup_of_run(args, world: int, gpu_name: str, gpu_memory_gb: float) -> Setup:
    """A script's flags (grpo.py, ppo.py, dpo.py) as the planner's inputs, at the worst case for memory: every
    prompt and response as long as their limits. The training ranks hold a vLLM engine when colocated with it."""
    pairs = not getattr(args, "online", True)  # offline dpo.py: pairs of a dataset, no engine
    engine = not pairs and not args.rollout_ranks and args.rollout_engine == "vllm"
    share = args.rollout_gpu_memory if engine and args.rollout_gpu_memory and args.rollout_gpu_memory <= 1 else None
    kv_gib = args.rollout_gpu_memory if engine and args.rollout_gpu_memory and args.rollout_gpu_memory > 1 else None
    samples = getattr(args, "pairs_per_step", 0) if pairs else args.prompts_per_step * args.group_size
    prompt = args.max_len // 2 if pairs else args.max_prompt_len
    response = args.max_len - prompt if pairs else args.max_response_len
    kind = next((k for k in GPUS if k in gpu_name), "H100")
    return Setup(gpus=world, gpu=kind, gpu_memory_gb=gpu_memory_gb, prompt_len=prompt, max_prompt_len=prompt,
                 response_len=response, max_response_len=response, samples=samples,
                 max_tokens_per_micro_batch=args.max_tokens_per_micro_batch, precision=args.precision,
                 lora_rank=args.lora_rank, offload=getattr(args, "offload", False),
                 activation_checkpointing=bool(args.activation_checkpointing), compile=args.compile,
                 sequence_parallel=args.sequence_parallel, shard_size=args.shard_size, rollout=engine,
                 vllm_memory_gb=share and share * gpu_memory_gb, kv_cache_gb=kv_gib and kv_gib * 2**30 / GB,
                 rollout_tp=getattr(args, "rollout_tp", 1), rollout_eager=getattr(args, "rollout_eager", False),
                 sleep_level=getattr(args, "rollout_sleep_level", None),
                 critic=hasattr(args, "critic_lr"),
                 reference=not args.lora_rank and (getattr(args, "kl_coef", 0) > 0 or getattr(args, "ref_cache", "")
                                                   == "none"),
                 pairs=pairs, epochs=getattr(args, "epochs", 1),
                 old_logprobs_pass=hasattr(args, "critic_lr") or getattr(args, "epochs", 1) > 1
                 or getattr(args, "num_mini_batches", 1) > 1)


def plan_run(args, world: int, device, config) -> list[str]:
    """At start-up, on GPUs: the planner's forecast for this run (lines to print) and, where --activation-checkpointing
    was not given (neither it nor --no-activation-checkpointing), its choice: on when the step would not fit without
    it. Memory and time are both at the worst case, every response as long as its limit: right for memory, an upper
    bound for the step (the step line says so). config: the transformers config of --model. On CPU there is nothing
    to plan."""
    global _plan
    if device.type != "cuda":
        return []
    shape = Shape.from_config(config)
    total = torch.cuda.mem_get_info(device)[1] / GB
    setup = setup_of_run(args, world, torch.cuda.get_device_name(device), total)
    lines = []
    if not given_on_command_line("activation_checkpointing"):
        peak = memory(shape, setup)["peak"]
        if not within_headroom(peak, setup):
            args.activation_checkpointing = True
            setup = replace(setup, activation_checkpointing=True)
            lines.append(f"planner: --activation-checkpointing on: the step needs about {peak:.0f} GB without it, "
                         f"more than {HEADROOM:.0%} of the GPU's {total:.0f} GB")
    _plan = (shape, setup)
    longest = "every pair runs to --max-len" if setup.pairs else "every response runs to --max-response-len"
    report = describe(shape, setup, step_assumes=f"if {longest}, an upper bound")
    return lines + ["planner: " + line for line in report[1:]]


def out_of_memory_report(stage: str, step: int, error: BaseException) -> str:
    """The one line a stage that ran out of GPU memory says: where, what is in use, and the flags that would fit.
    stage "start-up": before the loop (loading the models, starting the engine). The GPU's own count of what is in
    use, not PyTorch's: vLLM's sleep mode unmaps memory that PyTorch's allocator still counts as allocated."""
    line = "out of GPU memory at start-up" if stage == "start-up" else \
        f"out of GPU memory in stage '{stage}' of step {step}"
    if torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info()
        line += f": {(total - free) / GB:.1f} of {total / GB:.1f} GB in use"
    line += f" ({' '.join(str(error).split()).split(' Including non-PyTorch')[0][:200]})"  # PyTorch's first sentences
    if _plan is not None:
        shape, setup = _plan
        mem = memory(shape, setup)
        phase = "rollout" if stage in ("start-up", "rollout", "generate", "eval", "sync", "check_sync") else "training"
        parts = ", ".join(f"{k} {v:.1f}" for k, v in mem[phase].items() if v >= 0.05)
        found = fixes(shape, setup)
        line += f"; the planner expects {sum(mem[phase].values()):.1f} GB ({parts})"
        line += "; would fit with: " + ("; ".join(flag for flag, _ in found) if found else
                                        "no single flag: more GPUs, or a smaller model")
    return line


def start_up_out_of_memory_report(error: BaseException) -> str:
    return out_of_memory_report("start-up", 0, error)


errors.on_out_of_memory(start_up_out_of_memory_report)  # what common/run/errors.py prints for one at start-up
