"""Where do the rollout engine's and the trainer's log-probs part? Per-token log-probs of the same sampled tokens
under several numerical settings, each compared with an fp32 forward pass of the same weights.

    python benchmarks/bench_mismatch.py --model /tmp/smollm2 --data addition.jsonl --prompts 32 --out mismatch.json

Responses are sampled by vLLM when installed and on a GPU, once per --vllm-dtypes entry, with its own log-probs of
them (else by the model's own generate). Then each setting scores every sample's tokens:
  fp32            weights and arithmetic in fp32: the reference
  bf16            weights and arithmetic in bf16 (what vLLM runs)
  autocast        fp32 weights, bf16 matmuls under autocast
  bf16+fp32_head  bf16, but the final norm and LM head in fp32
  bf16+fp32_norm  bf16, but every RMSNorm in fp32
  trainer         the training path itself: FSDP2 (bf16 compute over fp32 weights on a GPU), packed rows with the
                  varlen attention kernel, the LM head in chunks (common/train/logprobs.compute_logprobs)
  trainer_fp32    the same with --precision fp32 (FSDP2 computing in fp32, sdpa attention)
Reported per sampling run: the mean absolute difference per token from fp32 and from that vLLM run's log-probs, so
a setting that closes most of the gap points at the stage that opens it, and vLLM in float32 shows what running
both sides in fp32 would leave; with the generation speed of each vLLM dtype (its cost).
"""

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common.data.prompts import load_rows, tokenize_prompts  # noqa: E402
from common.train.model import token_logprobs  # noqa: E402


def sequence_logprobs(model, sequences: list[tuple[list[int], list[int]]], device, autocast: bool = False,
                      temperature: float = 1.0) -> list[torch.Tensor]:
    """Log-probs of each response's tokens given its prompt, one sequence at a time (no padding to get wrong)."""
    out = []
    for prompt, response in sequences:
        ids = torch.tensor([prompt + response], device=device)
        with torch.no_grad(), torch.autocast(device.type, torch.bfloat16, enabled=autocast):
            logprobs, _ = token_logprobs(model, ids, torch.ones_like(ids), temperature)  # [1, len - 1]
        out.append(logprobs[0, len(prompt) - 1:].cpu())
    return out


def with_fp32(model, kinds: tuple[str, ...]):
    """Runs the named module kinds (by class name: 'RMSNorm', 'lm_head') in fp32 inside a bf16 model."""
    for name, module in model.named_modules():
        head = name.endswith("lm_head") or name.endswith("model.norm")  # the final norm feeds the head
        if "lm_head" in kinds and head or "RMSNorm" in kinds and "RMSNorm" in type(module).__name__:
            for key, param in list(module.named_parameters(recurse=False)):  # a copy: a tied head stays apart
                setattr(module, key, torch.nn.Parameter(param.detach().float(), requires_grad=False))
            module.register_forward_pre_hook(lambda m, args: tuple(a.float() for a in args))
            if not ("lm_head" in kinds and head):  # back to bf16 for the next bf16 layer
                module.register_forward_hook(lambda m, args, out: out.to(torch.bfloat16))
    return model


def sample(args, prompts: list[list[int]], device, vllm_dtype: str | None):
    """[(prompt ids, response ids)], the sampler's log-probs of them (None without vLLM) and tokens per second."""
    if vllm_dtype is not None:
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"  # this process has used CUDA: its engine can't fork
        from vllm import LLM, SamplingParams
        llm = LLM(args.model, dtype=vllm_dtype, gpu_memory_utilization=0.2, seed=0, enforce_eager=args.eager,
                  logprobs_mode="processed_logprobs", generation_config="vllm")  # no sampling defaults from the model
        params = SamplingParams(max_tokens=args.max_new_tokens, temperature=args.temperature, logprobs=0, seed=0)
        start = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        seconds = time.perf_counter() - start
        responses = [list(o.outputs[0].token_ids) for o in outs]
        engine = [torch.tensor([lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
                  for o in outs]
        del llm
        torch.cuda.empty_cache()
        return list(zip(prompts, responses)), engine, sum(map(len, responses)) / seconds
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).to(device)
    torch.manual_seed(0)
    responses = []
    for p in prompts:
        out = model.generate(torch.tensor([p], device=device), do_sample=True, temperature=args.temperature,
                             max_new_tokens=args.max_new_tokens, top_k=0)
        responses.append(out[0, len(p):].tolist())
    return list(zip(prompts, responses)), None, None


def trainer_logprobs(model, sequences, device, temperature: float) -> list[torch.Tensor]:
    """The training path's log-probs of the responses (see the module docstring)."""
    from common.train.logprobs import compute_logprobs
    samples = [{"prompt_ids": p, "response_ids": r} for p, r in sequences]
    return compute_logprobs(model, samples, max_tokens=16384, temperature=temperature, device=device)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--data", required=True, help=".jsonl with the prompts")
    p.add_argument("--prompt-key", default="question")
    p.add_argument("--answer-key", default="answer")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--eager", action="store_true", help="vLLM without CUDA graphs")
    p.add_argument("--vllm-dtypes", nargs="+", default=["bfloat16"],
                   help="sample once with vLLM in each of these dtypes (bfloat16: the rollouts' own; float32)")
    p.add_argument("--out", default=None, help="write the figures as JSON here")
    args = p.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from common.run.distributed import init_distributed
    from common.train.logprobs import use_packed_attention
    from common.train.model import shard_model

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    rows = load_rows(args.data, "train", args.prompt_key, args.answer_key)[:args.prompts]
    prompts = [r["prompt_ids"] for r in tokenize_prompts(rows, tokenizer, max_prompt_len=10**6)[0]]  # as training
    try:
        import vllm  # noqa: F401
        use_vllm = device.type == "cuda"
    except ImportError:
        use_vllm = False
    runs = {dtype: sample(args, prompts, device, dtype) for dtype in args.vllm_dtypes} if use_vllm \
        else {"hf_generate_fp32": sample(args, prompts, device, None)}

    def load(dtype):
        return AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(device).eval()

    init_distributed()  # a world of one, for the FSDP2 trainer path (after vLLM, which starts its own processes)
    trainer = shard_model(load(torch.float32), device, trainable=False)
    trainer_fp32 = shard_model(load(torch.float32), device, trainable=False, precision="fp32")
    for model in (trainer, trainer_fp32):
        use_packed_attention(model, device)
    settings = {
        "fp32": lambda seqs: sequence_logprobs(load(torch.float32), seqs, device, temperature=args.temperature),
        "autocast": lambda seqs: sequence_logprobs(load(torch.float32), seqs, device, True, args.temperature),
        "bf16": lambda seqs: sequence_logprobs(load(torch.bfloat16), seqs, device, temperature=args.temperature),
        "bf16+fp32_head": lambda seqs: sequence_logprobs(with_fp32(load(torch.bfloat16), ("lm_head",)), seqs, device,
                                                         temperature=args.temperature),
        "bf16+fp32_norm": lambda seqs: sequence_logprobs(with_fp32(load(torch.bfloat16), ("RMSNorm",)), seqs, device,
                                                         temperature=args.temperature),
        "trainer": lambda seqs: trainer_logprobs(trainer, seqs, device, args.temperature),
        "trainer_fp32": lambda seqs: trainer_logprobs(trainer_fp32, seqs, device, args.temperature),
    }
    report = {"model": args.model, "device": str(torch.cuda.get_device_name() if device.type == "cuda" else "cpu"),
              "runs": {}}
    for name, (sequences, engine, tokens_per_s) in runs.items():
        keep = [i for i, (_, response) in enumerate(sequences) if response]
        sequences = [sequences[i] for i in keep]
        results = {setting: score(sequences) for setting, score in settings.items()}
        reference = torch.cat(results["fp32"])
        run = {"sequences": len(sequences), "tokens": reference.numel(), "mean_abs_diff_vs_fp32": {}}
        if engine is not None:
            engine = torch.cat([engine[i] for i in keep])
            results["vllm"] = [engine]
            run["generate_tokens_per_s"] = tokens_per_s
        for setting, values in results.items():
            run["mean_abs_diff_vs_fp32"][setting] = (torch.cat(values) - reference).abs().mean().item()
        if engine is not None:
            run["mean_abs_diff_vs_vllm"] = {setting: (torch.cat(v) - engine).abs().mean().item()
                                            for setting, v in results.items() if setting != "vllm"}
        report["runs"][name] = run
    print(json.dumps(report, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
