"""The capacity planner: what a configuration needs of each GPU and how long its step takes, before it runs, and which
flags would make one that does not fit fit (scripts/plan.py prints it; common/run/run_plan.py applies it to a script's
flags at start-up and when a stage runs out of memory). This module is the model alone: numbers in, numbers out.

Memory per GPU, by part (GB):
  weights       trained parameters in fp32 (the master copy), frozen ones (a LoRA base) in the compute dtype, both
                sharded over the shard group (every training rank, or --shard-size of them)
  gradients     fp32, sharded like the weights, of the trained parameters only
  optimizer     AdamW's two fp32 moments of the trained parameters
  gathered      FSDP2's unsharded copies in the compute dtype while a pass runs: two decoder layers and the root
                (embeddings, final norm, LM head)
  activations   what the backward keeps of one micro-batch of this rank's tokens (a row's 1/N with sequence
                parallelism): every layer's saved tensors, or with activation checkpointing each layer's input and
                one layer's recomputed tensors
  logits        the chunked LM head's fp32 [chunk, vocab] buffers
  optimizer step
                AdamW's update (foreach, as torch picks for FSDP2's DTensors) allocates the square root of the second
                moments, 4 bytes a trained parameter sharded like them, once the backward has freed the gathered
                copies, activations and logits: what it needs beyond those (full fine-tuning with checkpointing or
                short micro-batches peaks here)
  other models  PPO's critic (trained like the policy), a frozen reference (--kl-coef without LoRA) or reward model
  vllm          the colocated engine: its weights (on the GPU while training only at sleep level 0), its KV cache and
                workspace while it generates
  overhead      the CUDA context and the allocator's slack
The peak is that of the training phase or of the rollout phase, whichever is larger (the engine sleeps while the
trainer runs; the trainer's weights and optimizer stay while the engine generates, unless --offload).

Time per step, by stage (s): rollout (decoding: as many engine steps as the longest response has tokens, each reading
the weights at a fitted share of the memory bandwidth with a fixed cost per layer (launches; all-reduces with
--rollout-tp), plus each sequence's KV cache over its own tokens and a fixed cost per generated token; eager, the CPU's
part overlaps the GPU's reads; the longest response follows from the mean as response_lengths says), logprobs
(forward passes: 2 FLOPs per parameter and token), update (6 FLOPs per trained parameter and token, 4 per frozen one,
2 more with activation checkpointing, at an MFU that grows with the model's size), both plus attention's FLOPs, which
grow with the square of each sequence's length (attention_flops), sync (a fixed cost and the rollout weights at a
fitted bandwidth).
The coefficients in FIT were fitted to the committed GPU runs (scripts/plan.py --validate prints the comparison;
benchmarks/README.md, Capacity planner).

Mixtures of experts: common/run/shapes.py says how their parameters, activations and FLOPs are counted.
"""

import math
from dataclasses import dataclass, replace

from common.run import gpus
from common.run.gpus import GPUS
from common.run.response_lengths import response_lengths
from common.run.shapes import Shape, heads_split

GB = 1e9

# Fitted to the committed GPU runs (scripts/plan.py --fit): see the module's docstring for what each scales.
FIT = {
    "act_h": 22.1,  # activation bytes (bf16) per token and layer per unit of hidden size (no checkpointing)
    "act_i": 8.82,  # the same per unit of MLP size
    "compile_act_share": 0.684,  # what compiled layers keep of that (fused kernels save fewer intermediates)
    "ckpt_h": 2.0,  # with activation checkpointing: bytes per token and layer per unit of hidden size kept
    "logit_copies": 1.83,  # fp32 [chunk, vocab] buffers alive at once in the chunked LM head
    "overhead_gb": 3.14,  # CUDA context, NCCL and the allocator's slack on a training GPU
    "vllm_overhead_gb": 6.0,  # vLLM's workspace, sampler and CUDA graphs beside its weights and KV cache
    "mfu_at_1b": 0.353,  # training MFU of a 1B-parameter model (bf16, packed micro-batches)
    "mfu_per_decade": 0.117,  # its change per factor 10 in parameters
    "compile_gain": 1.39,  # MFU with torch.compile'd layers over eager
    "fp32_share": 0.11,  # MFU in fp32 arithmetic over bf16
    "moe_share": 0.551,  # a mixture of experts' MFU (on its active parameters) over a dense model's of that size
    "layer_pass_s": 0.00569,  # fixed cost of one layer's forward and backward over one micro-batch (launches), eager
    "compile_pass_share": 1.0,  # what compiled layers keep of that
    "longest_over_mean": 4.03,  # a trained model's longest response of a step over the mean (decoding waits for it)
    "decode_bw_share": 0.812,  # the share of the HBM bandwidth a decoding step reads weights and KV at
    "decode_layer_s": 2.02e-05,  # fixed cost per decoder layer of one engine step with CUDA graphs
    "decode_layer_eager_s": 0.000562,  # the same without them (--rollout-eager): the CPU's kernel launches
    "decode_token_s": 2.55e-05,  # fixed cost per generated token: sampling it and processing the engine's output
    "decode_tp_layer_s": 0.000127,  # added per layer with --rollout-tp > 1: its all-reduces
    "prefill_mfu": 0.6,  # MFU of the prompts' prefill
    "sync_gb_s": 21.2,  # weights streamed into the colocated engine, GB/s
    "sync_s": 0.116,  # fixed cost of a sync: waking the engine, gathering the shards, resetting its prefix cache
}

HEADROOM = 0.9  # a configuration fits when its predicted peak is within this share of the GPU (the model's median
# error is 5%, and a step's micro-batches differ)



@dataclass
class Setup:
    """A configuration: the machine, the lengths and batch, and the flags the memory and time depend on."""
    gpus: int = 1
    gpu: str = "H100"
    gpu_memory_gb: float | None = None  # None: the kind's
    prompt_len: float = 256  # mean tokens
    response_len: float = 512  # mean tokens
    max_response_len: int = 1024  # the longest response (what decoding waits for)
    max_prompt_len: int = 256
    samples: int = 256  # per step, over every GPU (prompts x group size)
    max_tokens_per_micro_batch: int = 16384
    precision: str = "bf16"
    lora_rank: int = 0
    offload: bool = False
    activation_checkpointing: bool = False
    sequence_parallel: int = 1
    shard_size: int | None = None
    rollout: bool = True  # a colocated engine generates (offline DPO: none)
    rollout_tp: int = 1
    rollout_eager: bool = False
    response_lengths: str = "natural"  # or "geometric" (random weights): how long the longest is (response_lengths)
    sleep_level: int | None = None  # None: the scripts' default (0 when vLLM's weights take at most 15% of the GPU)
    kv_cache_gb: float | None = None  # None: the scripts' default size
    vllm_memory_gb: float | None = None  # --rollout-gpu-memory as a share of the GPU: vLLM's whole pool
    compile: bool = False
    trained_fraction: float = 1.0  # GRPO trains the groups with signal only: the share of samples that have it
    trainer_cache_kept: bool = True  # the trainer's freed blocks stay cached while vLLM fits beside them (False: the
    # code of older runs, which handed them back before every wake-up)
    critic: bool = False  # PPO
    reference: bool = False  # a frozen reference model (kl_coef > 0 without LoRA, DPO without a cache)
    pairs: bool = False  # DPO: each sample is a pair (two responses)
    epochs: int = 1
    old_logprobs_pass: bool = False  # GRPO with several optimizer steps a batch, PPO: a pass of its own

    @property
    def memory_gb(self) -> float:
        return self.gpu_memory_gb or GPUS[self.gpu][2]


def _dtype_bytes(precision: str) -> int:
    return 4 if precision == "fp32" else 2


def default_sleep_level(shape: Shape, setup: Setup) -> int:
    """common/rollout/vllm_engine.py's default: 0 while vLLM's weights take at most KEEP_WEIGHTS_UP_TO of the GPU."""
    if setup.sleep_level is not None:
        return setup.sleep_level
    return gpus.default_sleep_level(shape.params * _dtype_bytes(setup.precision) / setup.rollout_tp, setup.memory_gb * GB)


def kv_cache_gb(shape: Shape, setup: Setup) -> float:
    """The KV cache the scripts size by default (common/rollout/vllm_engine.py's): a replica's sequences at once, each
    of --max-prompt-len + --max-response-len tokens, a tenth more, at most KV_CACHE_CAP of the GPU."""
    if setup.kv_cache_gb is not None:
        return setup.kv_cache_gb
    per_token = 2 * shape.layers * max(1, shape.kv_heads // setup.rollout_tp) * shape.head_dim * \
        _dtype_bytes(setup.precision)
    gib = gpus.kv_cache_size_gib(per_token, setup.samples / setup.gpus * setup.rollout_tp,
                                 setup.max_prompt_len + setup.max_response_len, setup.memory_gb * GB / 2**30)
    return gib * 2**30 / GB


def memory(shape: Shape, setup: Setup, fit: dict = FIT) -> dict:
    """Per-GPU memory by part, GB: {"training": {part: GB}, "rollout": {part: GB}, "peak": GB, "phase": name,
    "allocated": the training phase's PyTorch tensors alone}. In the rollout phase the trainer's allocator keeps the
    blocks the training phase freed when the engine fits beside them (common/rollout/vllm_engine.py's _make_room), else it
    hands them back and only what stays resident remains."""
    shard = setup.shard_size or setup.gpus
    compute = _dtype_bytes(setup.precision)
    trained, frozen = shape.trained_and_frozen(setup.lora_rank)
    models = 2 if setup.critic else 1  # PPO's critic: the policy's size, trained the same way
    resident = {"weights": models * (4 * trained + compute * frozen) / shard / GB,
                "optimizer": models * 8 * trained / shard / GB}
    if setup.reference:
        resident["other models"] = shape.params * compute / shard / GB
    if setup.offload:  # outside their phases the other models and the optimizer wait in CPU memory
        resident = {"weights": (4 * trained + compute * frozen) / shard / GB}
    tokens = min(setup.max_tokens_per_micro_batch, _tokens_per_gpu(setup) * setup.trained_fraction) / \
        setup.sequence_parallel
    # bytes a token keeps in one layer (a mixture's: its k experts' MLP activations and its routing buffers)
    per_layer = ((fit["act_h"] * shape.hidden + fit["act_i"] * shape.mlp_width) * compute / 2
                 + shape.routing_bytes(compute)) * (fit["compile_act_share"] if setup.compile else 1.0)
    if setup.activation_checkpointing:  # each layer's input, and one layer recomputed at a time
        activations = tokens * (shape.layers * fit["ckpt_h"] * shape.hidden + per_layer)
    else:
        activations = tokens * shape.layers * per_layer
    training = {**resident, "gradients": 4 * trained / shard / GB,
                "optimizer": 8 * trained / shard / GB if setup.offload else resident["optimizer"],
                "gathered": (2 * shape.layer_params + shape.root_params) * compute / GB,
                "activations": activations / GB,
                "logits": fit["logit_copies"] * min(2048, tokens) * shape.vocab * 4 / GB}
    backward = training["gathered"] + training["activations"] + training["logits"]
    training["optimizer step"] = max(0.0, 4 * trained / shard / GB - backward)  # one model's step at a time
    allocated = sum(training.values())
    training["overhead"] = fit["overhead_gb"]
    rollout = {}
    if setup.rollout:
        vllm = {"vllm weights": shape.params * compute / setup.rollout_tp / GB, "kv cache": kv_cache_gb(shape, setup),
                "vllm workspace": fit["vllm_overhead_gb"]}
        if setup.vllm_memory_gb:  # a share of the GPU: the pool holds weights, KV cache and workspace
            vllm["vllm workspace"] = max(0.0, setup.vllm_memory_gb - vllm["vllm weights"] - vllm["kv cache"])
        if default_sleep_level(shape, setup) == 0:
            training["vllm weights"] = vllm["vllm weights"]
        cached = sum(training.values()) - training.get("vllm weights", 0.0)
        if setup.trainer_cache_kept and cached + sum(vllm.values()) + 2**30 / GB <= setup.memory_gb:  # a GiB spare
            rollout = {"trainer (cached)": cached, **vllm}
        else:
            rollout = {**resident, "overhead": fit["overhead_gb"], **vllm}
    peaks = {"training": sum(training.values()), "rollout": sum(rollout.values())}
    phase = max(peaks, key=peaks.get)
    return {"training": training, "rollout": rollout, "peak": peaks[phase], "phase": phase, "allocated": allocated}


def _tokens_per_gpu(setup: Setup) -> float:
    """The step's training tokens on one GPU (prompt + response of every sample, pairs counting both responses)."""
    per_sample = setup.prompt_len + setup.response_len * (2 if setup.pairs else 1)
    return setup.samples * per_sample / setup.gpus * setup.sequence_parallel


def mfu(shape: Shape, setup: Setup, fit: dict = FIT) -> float:
    """The training MFU the fit expects of a model this size (bf16 over packed micro-batches; compiled layers gain a
    fitted factor; fp32 arithmetic runs at a fitted fraction of bf16's). The size is the active parameters: a token's
    matmuls are those of its experts, not of all; transformers' expert layers run them at a fitted fraction of a
    dense model's rate)."""
    value = fit["mfu_at_1b"] + fit["mfu_per_decade"] * math.log10(shape.active_params / 1e9)
    value *= (fit["compile_gain"] if setup.compile else 1.0) * (fit["fp32_share"] if setup.precision == "fp32" else 1.0)
    value *= fit["moe_share"] if shape.experts else 1.0
    return min(0.6, max(0.01, value))


def attention_flops(shape: Shape, setup: Setup) -> float:
    """FLOPs of attention's two products (Q K^T and the weighted sum of V) in one forward pass over the step's samples:
    a causal sequence of L tokens costs 2 x layers x (heads x head_dim) x L^2 (half of a full 4 x ... x L^2), the
    backward twice that. From the mean lengths, each sample one row (a DPO pair two): long-tailed lengths make the true
    sum of L^2, and so this cost, larger."""
    rows = [setup.prompt_len + setup.response_len] * (2 if setup.pairs else 1)
    return setup.samples * sum(2 * shape.layers * shape.heads * shape.head_dim * length ** 2 for length in rows)


def step_time(shape: Shape, setup: Setup, fit: dict = FIT) -> dict:
    """Seconds per step by stage, and their sum. Training counts the dense FLOPs per token (of the active parameters)
    and attention's per sequence (forward, backward, and with activation checkpointing the forward once more), all at
    the fitted MFU. Decoding reads every parameter each engine step, a mixture's every expert."""
    flops, bandwidth, _ = GPUS[setup.gpu]
    trained, frozen = shape.trained_and_frozen(setup.lora_rank, active=True)
    tokens = setup.samples * (setup.prompt_len + setup.response_len * (2 if setup.pairs else 1))
    trained_tokens = tokens * setup.trained_fraction
    per_token = 6 * trained + 4 * frozen + (2 * shape.active_params if setup.activation_checkpointing else 0)
    attention = attention_flops(shape, setup) * setup.trained_fraction  # one forward pass
    models = 2 if setup.critic else 1
    rate = setup.gpus * flops * mfu(shape, setup, fit)
    micro_batches = math.ceil(_tokens_per_gpu(setup) * setup.trained_fraction / setup.max_tokens_per_micro_batch)
    launches = micro_batches * shape.layers * fit["layer_pass_s"] * (fit["compile_pass_share"] if setup.compile else 1)
    update_flops = per_token * trained_tokens + attention * (4 if setup.activation_checkpointing else 3)
    stages = {"update": models * setup.epochs * (update_flops / rate + launches)}
    passes = setup.old_logprobs_pass + setup.reference + setup.critic
    if passes:
        stages["logprobs"] = passes * ((2 * shape.active_params * trained_tokens + attention) / rate + launches / 3)
    if setup.rollout:
        compute = _dtype_bytes(setup.precision)
        weights = shape.params * compute / setup.rollout_tp  # every expert: a batch's tokens touch nearly all
        sequences = setup.samples / setup.gpus * setup.rollout_tp
        steps, mean_square = response_lengths(setup, fit)
        # each sequence reads its prompt and the response so far at each of its own steps: P x L + L^2 / 2 tokens
        kv_read = sequences * (setup.prompt_len * setup.response_len + mean_square / 2) * \
            shape.kv_bytes_per_token / 2 * compute / setup.rollout_tp
        per_layer = (fit["decode_layer_eager_s"] if setup.rollout_eager else fit["decode_layer_s"]) + \
            (fit["decode_tp_layer_s"] if setup.rollout_tp > 1 else 0.0)
        launches = steps * shape.layers * per_layer + sequences * setup.response_len * fit["decode_token_s"]
        reads = (steps * weights + kv_read) / (bandwidth * fit["decode_bw_share"])
        prefill = sequences * setup.prompt_len * 2 * shape.active_params / setup.rollout_tp / \
            (flops * fit["prefill_mfu"])
        # the CPU's share (launches, and each token's sampling and output processing) and the GPU's reads: with CUDA
        # graphs one after the other; eager, the CPU launches the next kernels while the GPU reads, the slower leads
        stages["rollout"] = (max(launches, reads) if setup.rollout_eager else launches + reads) + prefill
        stages["sync"] = fit["sync_s"] + weights / (fit["sync_gb_s"] * GB)
    return {**stages, "step": sum(stages.values())}


def fits(shape: Shape, setup: Setup, fit: dict = FIT) -> bool:
    return within_headroom(memory(shape, setup, fit)["peak"], setup)


def within_headroom(peak: float, setup: Setup) -> bool:
    return peak <= HEADROOM * setup.memory_gb


def fixes(shape: Shape, setup: Setup, fit: dict = FIT) -> list[tuple[str, float]]:
    """Flags (and the peak GB they would give) that bring a configuration under the GPU's memory (with HEADROOM),
    cheapest first: activation checkpointing, a smaller micro-batch, offload, sequence parallelism, LoRA, vLLM's
    weights off the GPU while training; where no single one does, activation checkpointing with one of the others."""
    options = []
    for budget in (8192, 4096, 2048):
        if budget < setup.max_tokens_per_micro_batch:
            options.append((f"--max-tokens-per-micro-batch {budget}", {"max_tokens_per_micro_batch": budget}))
    if not setup.offload and (setup.critic or setup.reference):
        options.append(("--offload", {"offload": True}))
    for n in (2, 4, 8):
        if n > setup.sequence_parallel and setup.gpus % n == 0 and heads_split(shape.heads, shape.kv_heads, n):
            options.append((f"--sequence-parallel {n}", {"sequence_parallel": n}))
    if not setup.lora_rank:
        options.append(("--lora-rank 32", {"lora_rank": 32}))
    if setup.rollout and default_sleep_level(shape, setup) == 0:
        options.append(("--rollout-sleep-level 2", {"sleep_level": 2}))
    checkpointing = [] if setup.activation_checkpointing else [("--activation-checkpointing",
                                                                {"activation_checkpointing": True})]

    def fitting(candidates):
        found = []
        for flag, changes in candidates:
            peak = memory(shape, replace(setup, **changes), fit)["peak"]
            if within_headroom(peak, setup):
                found.append((flag, peak))
        return found

    found = fitting(checkpointing + options)
    if not found and checkpointing:
        found = fitting([(f"{checkpointing[0][0]} {flag}", {**checkpointing[0][1], **changes})
                         for flag, changes in options])
    return found


def describe(shape: Shape, setup: Setup, fit: dict = FIT, step_assumes: str = "") -> list[str]:
    """The planner's report in lines: memory by part per phase, the peak against the GPU, the step by stage (and,
    where step_assumes is given, what the step's figure assumes)."""
    mem, time_ = memory(shape, setup, fit), step_time(shape, setup, fit)
    mlp = f"MLP {shape.intermediate}"
    if shape.experts:
        mlp = f"{shape.experts} experts of MLP {shape.intermediate}, {shape.experts_per_token} a token" + (
            f", a shared expert of MLP {shape.shared_intermediate}" if shape.shared_intermediate else "")
    active = f", {shape.active_params / 1e9:.2f}B active" if shape.experts else ""
    lines = [f"model: {shape.params / 1e9:.2f}B parameters{active} ({shape.layers} layers, hidden {shape.hidden}, "
             f"{mlp}, {shape.heads} heads / {shape.kv_heads} kv, vocabulary {shape.vocab})"]
    for phase in ("training", "rollout"):
        if mem[phase]:
            parts = ", ".join(f"{k} {v:.1f}" for k, v in mem[phase].items() if v >= 0.05)
            lines.append(f"{phase}: {sum(mem[phase].values()):.1f} GB per GPU ({parts})")
    fit_ok = within_headroom(mem["peak"], setup)
    lines.append(f"peak: {mem['peak']:.1f} GB of {setup.memory_gb:.0f} ({mem['phase']} phase): "
                 + ("fits" if fit_ok else f"does not fit (a plan fits within {HEADROOM:.0%} of the GPU)"))
    if not fit_ok:
        found = fixes(shape, setup, fit)
        lines.append("would fit with: " + ("; ".join(f"{flag} ({peak:.1f} GB)" for flag, peak in found)
                                           if found else "none of the flags alone: more GPUs, or a smaller model"))
    lines.append(f"step: {time_['step']:.1f} s" + (f" {step_assumes}" if step_assumes else "") + " ("
                 + ", ".join(f"{k} {v:.1f}" for k, v in time_.items() if k != "step")
                 + f"; training at an MFU of {mfu(shape, setup, fit):.0%})")
    return lines
