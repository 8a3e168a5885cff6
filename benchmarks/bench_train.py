"""Benchmark the training step: packed token-budget micro-batches against padded fixed-size ones, in one run.

A random-weight Qwen2.5 shape under FSDP2 (bf16 compute, fp32 master weights, AdamW) on one GPU, or sharded over
several under torchrun, where every rank steps through the same batches (tokens/s and MFU are per GPU), fed batches of
samples whose responses have long-tailed lengths (lognormal, median --median-response, capped at --max-response)
after a --prompt-len-token prompt. Every step is GRPO-shaped: log-probs of the response tokens, an
advantage-weighted token-mean loss, backward, AdamW. Both modes see the same batches:
- packed: micro-batches of at most --max-tokens tokens packed into one row each (common/train/batching.py): varlen
  attention, the LM head in chunks on the response positions only;
- padded: --padded-micro-batch samples per micro-batch in arrival order, right-padded to their longest, sdpa with a
  padding mask and full float32 logits (common/train/model.token_logprobs): the naive step.
- synced: packed, reading five statistics of each micro-batch back to the host (`.item()`), as the training loops
  of grpo.py, ppo.py and dpo.py do: what a host sync per micro-batch costs.
- compiled: packed, with each decoder layer's forward and the LM head's per-chunk math torch.compiled
  (common/train/model.compile_model, what --compile does); the log-probs of a few samples before and after compiling
  are compared. compiled_layers: the decoder layers compiled, the head eager (runs before compiled).
Reports tokens/s (prompt + response tokens), MFU (6 x parameters x tokens / time / peak), padding fraction and peak
memory for each, as JSON to --out; --profile writes a torch.profiler summary of one step per mode.
Shapes: Qwen2.5's (0.5b, 1.5b, 7b) and SmolLM2-135M's (135m).

Long sequences: --lengths 8192 16384 32768 runs, for each length, steps of --num-samples sequences of exactly that
many tokens (a --prompt-len prompt and the rest response), each micro-batch one sequence, the model built once per
shape. --sequence-parallel N splits each row over N ranks (common/train/sequence_parallel.py: groups of N consecutive
ranks see the same batches; tokens/s and MFU are per GPU); --lora-rank R trains rank-R adapters on a frozen base
(common/train/lora.py), for a model whose full fine-tuning does not fit. Each result holds the first step's loss,
which is the same for every N (same weights, same batch), and an MFU that also counts attention's FLOPs
(6 x layers x hidden x length^2 per causal sequence, hidden = heads x head size, forward and backward), which at 32k is no longer small.

    python benchmarks/bench_train.py --out benchmarks/results/train_packing_1gpu.json
    python benchmarks/bench_train.py --tiny        # CPU smoke test, seconds
    torchrun --nproc_per_node 2 benchmarks/bench_train.py --shapes 7b --modes compiled --max-tokens 8192
    torchrun --nproc_per_node 2 benchmarks/bench_train.py --shapes 7b --lengths 16384 32768 --sequence-parallel 2 \
        --activation-checkpointing --num-samples 1 --modes packed
"""

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, LlamaConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root holds common/
from common.run.distributed import init_distributed  # noqa: E402
from common.run.perf import flop_weighted_params, mfu, peak_flops  # noqa: E402
from common.train.batching import batching_metrics, pack_sequences, plan_micro_batches  # noqa: E402
from common.train.logprobs import packed_token_logprobs, use_packed_attention  # noqa: E402
from common.train.lora import add_lora  # noqa: E402
from common.train.model import compile_model, shard_model, token_logprobs  # noqa: E402
from common.train.sequence_parallel import init_sequence_parallel, sequence_parallel_size  # noqa: E402
from scripts.random_model import LLAMA_SHAPES, SHAPES as QWEN_SHAPES, qwen2_config  # noqa: E402

# Defaults that fit one 80 GB H100 without activation checkpointing (7b: two H200s, peak 114 GB each): the packed token
# budget, and the padded baseline's samples per micro-batch (its full float32 logits over 4k-token rows are what runs
# out first).
MAX_TOKENS = {"135m": 16384, "0.5b": 16384, "1.5b": 8192, "7b": 8192, "tiny": 512}
PADDED_MICRO_BATCH = {"135m": 8, "0.5b": 4, "1.5b": 2, "7b": 1, "tiny": 4}


def sample_batch(num_samples: int, prompt_len: int, median: int, sigma: float, cap: int, vocab: int,
                 seed: int) -> list[dict]:
    """Random prompt + response token ids, the response length lognormal around `median` (sigma 0: exactly
    `median`), and an advantage each."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.exp(math.log(median) + sigma * torch.randn(num_samples, generator=g)).round().clamp(1, cap)
    if sigma == 0:
        lengths = torch.full((num_samples,), median)
    return [dict(prompt_ids=torch.randint(0, vocab, (prompt_len,), generator=g).tolist(),
                 response_ids=torch.randint(0, vocab, (int(n),), generator=g).tolist(),
                 advantage=float(torch.randn(1, generator=g))) for n in lengths]


def packed_step(model, optimizer, samples, max_tokens: int, chunk_tokens: int, device,
                host_syncs: int = 0) -> tuple[list[list[int]], torch.Tensor]:
    lengths = [len(s["prompt_ids"]) + len(s["response_ids"]) for s in samples]
    num_scored = sum(len(s["response_ids"]) for s in samples)
    plan, total = plan_micro_batches(lengths, max_tokens), torch.zeros((), device=device)
    for mb in plan:
        mb_samples = [samples[i] for i in mb]
        packed = pack_sequences([s["prompt_ids"] + s["response_ids"] for s in mb_samples],
                                [len(s["response_ids"]) for s in mb_samples])
        logprobs, _ = packed_token_logprobs(model, packed, temperature=1.0, chunk_tokens=chunk_tokens)  # [scored]
        advantages = torch.tensor([s["advantage"] for s in mb_samples]).repeat_interleave(
            torch.tensor(packed["num_scored"])).to(device)
        loss = -(logprobs * advantages).sum() / num_scored
        loss.backward()
        total += loss.detach()
        for _ in range(host_syncs):  # each waits for the GPU to finish everything queued so far
            loss.item()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return plan, total


def padded_step(model, optimizer, samples, micro_batch: int, device) -> list[list[int]]:
    num_scored, total = sum(len(s["response_ids"]) for s in samples), 0.0
    plan = [list(range(start, min(start + micro_batch, len(samples)))) for start in range(0, len(samples), micro_batch)]
    for mb in plan:
        seqs = [samples[i]["prompt_ids"] + samples[i]["response_ids"] for i in mb]
        longest = max(map(len, seqs))
        ids = torch.zeros(len(mb), longest, dtype=torch.long)
        mask = torch.zeros(len(mb), longest, dtype=torch.long)
        weights = torch.zeros(len(mb), longest - 1)  # per target: the advantage on response tokens
        for row, (i, seq) in enumerate(zip(mb, seqs)):
            p = len(samples[i]["prompt_ids"])
            ids[row, :len(seq)], mask[row, :len(seq)] = torch.tensor(seq), 1
            weights[row, p - 1:len(seq) - 1] = samples[i]["advantage"]
        logprobs, _ = token_logprobs(model, ids.to(device), mask.to(device), temperature=1.0)  # [batch, seq - 1]
        loss = -(logprobs * weights.to(device)).sum() / num_scored
        loss.backward()
        total = total + loss.detach()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return plan, total


def run_mode(mode: str, shape: str, model, optimizer, batches: list[list[dict]], args, device,
             max_tokens: int) -> dict:
    """The first batch warms up (allocator, kernels); the others are timed. OOM is reported, not raised."""
    def step(samples):
        if mode != "padded":
            return packed_step(model, optimizer, samples, max_tokens, args.chunk_tokens, device,
                               host_syncs=5 if mode == "synced" else 0)
        return padded_step(model, optimizer, samples, args.padded_micro_batch[shape], device)

    try:
        first_loss = float(step(batches[0])[1])  # before any update: the same for every --sequence-parallel
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        seconds, tokens, metrics = 0.0, 0, []
        if args.profile:  # one more step, untimed: the profiler slows the host down
            activities = [torch.profiler.ProfilerActivity.CPU] + (
                [torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else [])
            with torch.profiler.profile(activities=activities) as prof:
                step(batches[0])
                if device.type == "cuda":
                    torch.cuda.synchronize()
            write_profile(prof, f"{args.profile}_{shape}_{mode}.txt", device)
        for samples in batches[1:]:
            start = time.perf_counter()
            plan = step(samples)[0]
            if device.type == "cuda":
                torch.cuda.synchronize()
            seconds += time.perf_counter() - start
            lengths = [len(s["prompt_ids"]) + len(s["response_ids"]) for s in samples]
            tokens += sum(lengths)
            metrics.append(batching_metrics(plan, lengths, device, padded=mode == "padded"))
    except torch.OutOfMemoryError as e:
        optimizer.zero_grad(set_to_none=True)
        return {"error": f"out of memory: {str(e).splitlines()[0]}"}
    # DTensor.numel() is the full size; tied head once; a LoRA model's frozen base at 4 of 6 FLOPs a token
    num_params = flop_weighted_params([model])[1]
    sp = sequence_parallel_size()  # a group of sp GPUs processes each token once: per GPU, tokens / sp
    config = model.config
    attention = sum(6 * config.num_hidden_layers * config.hidden_size * n**2
                    for samples in batches[1:] for n in (len(s["prompt_ids"]) + len(s["response_ids"])
                                                         for s in samples))  # causal: half the QK^T and PV work
    dense, peak = mfu(num_params, tokens, seconds, peak_flops(device), num_gpus=sp), peak_flops(device)
    result = {"tokens_per_s": tokens / seconds / sp, "step_s": seconds / len(metrics), "mfu": dense,
              "mfu_with_attention": dense + attention / seconds / peak / sp if dense is not None else None,
              "first_loss": first_loss,
              "padding_frac": sum(m["batch/padding_frac"] for m in metrics) / len(metrics),
              "micro_batches_per_step": sum(m["batch/micro_batches_per_rank"] for m in metrics) / len(metrics),
              "tokens_per_micro_batch": sum(m["batch/tokens_per_micro_batch"] for m in metrics) / len(metrics),
              "tokens_per_step": tokens / len(metrics)}
    if device.type == "cuda":
        result["peak_memory_gb"] = torch.cuda.max_memory_allocated() / 2**30
        result["peak_reserved_gb"] = torch.cuda.max_memory_reserved() / 2**30
    return result


def write_profile(prof, path: str, device) -> None:
    """Where one training step's time goes: the costliest operators by device time (self time, so nothing is
    counted twice), then by host time, then the totals: busy device time against the step's wall time shows how
    much of the step the GPU sits idle waiting for the host to launch work."""
    events = prof.key_averages()
    lines = [f"# torch.profiler summary of one training step ({device})", ""]
    if device.type == "cuda":
        kernels = [e for e in events if e.device_type.name == "CUDA" and not e.is_user_annotation]
        busy = sum(e.self_device_time_total for e in kernels) / 1e6  # us -> s; one stream, so no overlap
        wall = max(e.time_range.end for e in prof.events()) - min(e.time_range.start for e in prof.events())
        kernels = sum(e.count for e in kernels)
        lines += [f"device busy {busy:.3f} s of the step's {wall / 1e6:.3f} s ({busy / (wall / 1e6):.0%}); "
                  f"{kernels} kernel launches", ""]
        lines += ["## by device time", events.table(sort_by="self_cuda_time_total", row_limit=30), ""]
    lines += ["## by host time", events.table(sort_by="self_cpu_time_total", row_limit=30)]
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text("\n".join(lines) + "\n")
    print(f"profile written to {path}", flush=True)


@torch.no_grad()
def compile_and_compare(model, samples: list[dict], args, device, head: bool) -> dict:
    """Compiles the decoder layers (and the head), and compares the packed log-probs of a few samples before and
    after."""
    use_packed_attention(model, device)
    packed = pack_sequences([s["prompt_ids"] + s["response_ids"] for s in samples[:8]],
                            [len(s["response_ids"]) for s in samples[:8]])
    model.compiled_head = False  # the reference: eager, or after compiled_layers its compiled layers
    eager, _ = packed_token_logprobs(model, packed, temperature=1.0, chunk_tokens=args.chunk_tokens)
    compile_model(model, head=head)
    start = time.perf_counter()
    compiled, _ = packed_token_logprobs(model, packed, temperature=1.0, chunk_tokens=args.chunk_tokens)
    first_call = time.perf_counter() - start
    model.reshard()
    diff = (compiled.float() - eager.float()).abs()
    return {"mean_abs_diff": diff.mean().item(), "max_abs_diff": diff.max().item(), "tokens": diff.numel(),
            "first_call_s": first_call}


def bench_shape(shape: str, args, device) -> dict:
    if shape in LLAMA_SHAPES:
        config = LlamaConfig(**LLAMA_SHAPES[shape], max_position_embeddings=8192)
    else:
        config = qwen2_config(shape)
    torch.manual_seed(0)
    with device:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model = add_lora(model, args, seed=0)
    model = shard_model(model, device, activation_checkpointing=args.activation_checkpointing,
                        precision=args.precision)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-6)
    results = {"num_params": sum(p.numel() for p in model.parameters()),
               "trained_params": flop_weighted_params([model])[0]}
    if args.lengths:  # single sequences of each length, the same model
        for length in args.lengths:
            batches = [sample_batch(args.num_samples, args.prompt_len, length - args.prompt_len, 0.0, length,
                                    config.vocab_size, seed=step) for step in range(args.steps + 1)]
            results[str(length)] = run_modes(shape, model, optimizer, batches, args, device, length)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    else:
        batches = [sample_batch(args.num_samples, args.prompt_len, args.median_response, args.sigma,
                                args.max_response, config.vocab_size, seed=step) for step in range(args.steps + 1)]
        results.update(run_modes(shape, model, optimizer, batches, args, device, args.max_tokens[shape]))
    del model, optimizer
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return results


def run_modes(shape: str, model, optimizer, batches: list[list[dict]], args, device, max_tokens: int) -> dict:
    results = {}
    order = ["packed", "padded", "synced", "compiled_layers", "compiled"]  # compiling changes the model: last
    for mode in sorted(args.modes, key=order.index):
        if mode.startswith("compiled"):  # packed, with each decoder layer compiled from here on
            results[f"{mode}_vs_eager_logprobs"] = compile_and_compare(model, batches[0], args, device,
                                                                      head=mode == "compiled")
        if mode != "padded" and args.packed_attention == "auto":
            results["packed_attention"] = use_packed_attention(model, device)
        elif mode != "padded":
            results["packed_attention"] = args.packed_attention
            model.set_attn_implementation(args.packed_attention)
        else:
            model.set_attn_implementation("sdpa")
        results[mode] = run_mode(mode, shape, model, optimizer, batches, args, device, max_tokens)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        print(f"{shape} {mode} (rows of up to {max_tokens} tokens): {json.dumps(results[mode])}", flush=True)
    if "tokens_per_s" in results.get("packed", {}) and "tokens_per_s" in results.get("padded", {}):
        results["packed_speedup"] = results["packed"]["tokens_per_s"] / results["padded"]["tokens_per_s"]
    for base, mode, name in (("packed", "synced", "synced_over_packed"), ("packed", "compiled", "compiled_speedup"),
                             ("compiled_layers", "compiled", "compiled_head_speedup")):  # tokens/s ratios
        if "tokens_per_s" in results.get(base, {}) and "tokens_per_s" in results.get(mode, {}):
            results[name] = results[mode]["tokens_per_s"] / results[base]["tokens_per_s"]
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", choices=sorted([*QWEN_SHAPES, *LLAMA_SHAPES]),
                        default=["0.5b", "1.5b"])
    parser.add_argument("--modes", nargs="+", choices=["packed", "padded", "synced", "compiled_layers", "compiled"],
                        default=["packed", "padded"],
                        help="synced: packed with five .item() reads per micro-batch; compiled: packed with each "
                             "decoder layer and the head's math torch.compiled, compiled_layers: the layers only "
                             "(these two run after the others)")
    parser.add_argument("--num-samples", type=int, default=256, help="samples per step (one optimizer step)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per mode, after one warm-up step")
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--median-response", type=int, default=300)
    parser.add_argument("--sigma", type=float, default=1.0, help="lognormal shape: 1.0 gives a mean of 1.65 x median")
    parser.add_argument("--max-response", type=int, default=4096)
    parser.add_argument("--max-tokens", type=int, default=None,
                        help=f"packed: token budget per micro-batch (default per shape: {MAX_TOKENS})")
    parser.add_argument("--chunk-tokens", type=int, default=2048, help="packed: tokens per LM-head chunk")
    parser.add_argument("--packed-attention", default="auto",
                        help="auto (varlen kernel on CUDA, sdpa on CPU), flex_attention, sdpa, ...")
    parser.add_argument("--padded-micro-batch", type=int, default=None,
                        help=f"padded: samples per micro-batch (default per shape: {PADDED_MICRO_BATCH})")
    parser.add_argument("--activation-checkpointing", action="store_true")
    parser.add_argument("--lengths", type=int, nargs="+", default=None, metavar="TOKENS",
                        help="long sequences: steps of --num-samples sequences of exactly TOKENS tokens each, one "
                             "micro-batch each (the token budget is the length), for each length in turn")
    parser.add_argument("--sequence-parallel", type=int, default=1, metavar="N",
                        help="split each packed row over N ranks (groups of N consecutive ranks)")
    parser.add_argument("--lora-rank", type=int, default=0, help="train LoRA adapters of this rank on a frozen base")
    parser.add_argument("--lora-alpha", type=float, default=32.0)
    parser.add_argument("--precision", choices=["bf16", "fp32"], default="bf16",
                        help="GPU compute dtype of the step (master weights stay fp32); MFU is against the bf16 peak")
    parser.add_argument("--profile", default=None, metavar="PREFIX",
                        help="profile one more step of each shape and mode, before the timed ones and not timed: a "
                             "summary to PREFIX_SHAPE_MODE.txt")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke test: tiny shape, few short samples")
    parser.add_argument("--out", default=None, help="JSON file for the results")
    args = parser.parse_args()
    if args.tiny:
        args.shapes, args.num_samples, args.steps, args.prompt_len = ["tiny"], 16, 1, 16
        args.median_response, args.max_response, args.chunk_tokens = 30, 200, 128
    args.max_tokens = {s: args.max_tokens or MAX_TOKENS[s] for s in args.shapes}
    args.padded_micro_batch = {s: args.padded_micro_batch or PADDED_MICRO_BATCH[s] for s in args.shapes}

    # Micro-batches of varying sizes fragment the caching allocator's fixed segments.
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    args.lora_targets = None  # every linear layer of attention and MLP
    rank, world, device = init_distributed()
    init_sequence_parallel(args.sequence_parallel)
    report = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "gpus": world,
              "torch": torch.__version__, "transformers": transformers.__version__, "args": vars(args),
              "results": {shape: bench_shape(shape, args, device) for shape in args.shapes}}
    if rank == 0:
        print(json.dumps(report, indent=2))
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
