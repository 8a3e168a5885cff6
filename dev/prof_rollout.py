# The script behind benchmarks/results/rollout_profile_smollm2_gsm8k_1xh200/ (run as a copy in the repo root at commit f7cb38b: `torchrun --standalone --nproc_per_node 1 prof_rollout.py --dtype bfloat16 --out r_bf16`, then `--dtype float32 --variants ours steps tprof cprof --out r_fp32`): where the colocated engine's rollout time goes on SmolLM2-135M-Instruct and 32 GSM8K prompts x 8, up to 512 tokens.
# Now: `torchrun --standalone --nproc_per_node 1 dev/prof_rollout.py ...` from the repo root.
import argparse, cProfile, functools, gc, io, json, pstats, statistics, sys, time
import torch, torch.distributed as dist
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root holds common/
from common.rollout.vllm_engine import VLLMRolloutEngine
from common.run.distributed import init_distributed

p = argparse.ArgumentParser()
p.add_argument("--model", default="/tmp/smollm2")
p.add_argument("--data", default="/tmp/data/gsm8k/train.jsonl")
p.add_argument("--dtype", default="bfloat16")
p.add_argument("--engine-kwargs", default="{}")
p.add_argument("--variants", nargs="+", default=["ours", "vllm_lp", "vllm_nolp", "gcoff", "steps", "cprof", "tprof"])
p.add_argument("--rounds", type=int, default=2)
p.add_argument("--out", required=True)
a = p.parse_args()
import vllm
extra = json.loads(a.engine_kwargs)
if extra:
    vllm.LLM = functools.partial(vllm.LLM, **extra)
from transformers import AutoModelForCausalLM, AutoTokenizer
rank, world, device = init_distributed()
tok = AutoTokenizer.from_pretrained(a.model)
rows = [json.loads(l) for l in open(a.data)][:32]
T = "{prompt}\nLet's think step by step and output the final answer after \"####\"."
prompts = [tok.apply_chat_template([{"role": "user", "content": T.format(prompt=r["question"])}], add_generation_prompt=True)
           for r in rows]
prompts = [list(x["input_ids"]) if isinstance(x, dict) or hasattr(x, "keys") else list(x) for x in prompts]
dtype = getattr(torch, a.dtype)
model = AutoModelForCausalLM.from_pretrained(a.model, dtype=dtype).to(device)
stop = [tok.eos_token_id]
engine = VLLMRolloutEngine(a.model, 1, 4.0, max_model_len=1024, stop_token_ids=stop, seed=0, dtype=dtype)
engine.update_weights(model)
del model
torch.cuda.empty_cache()
from vllm import SamplingParams
from vllm.inputs import TokensPrompt
out = {"dtype": a.dtype, "engine_kwargs": extra, "mean_prompt": statistics.mean(map(len, prompts))}

def ours(seed):
    r = engine.generate(prompts, n=8, max_tokens=512, temperature=1.0, top_p=1.0, seed=seed)
    return sum(len(c.response_ids) for g in r for c in g)

def vllm_gen(seed, lp):
    ps = [SamplingParams(n=8, max_tokens=512, temperature=1.0, seed=seed * 1000 + i, stop_token_ids=stop, detokenize=False,
                         **(dict(logprobs=0, flat_logprobs=True) if lp else {})) for i in range(len(prompts))]
    r = engine.llm.generate([TokensPrompt(prompt_token_ids=x) for x in prompts], ps, use_tqdm=False)
    return sum(len(c.token_ids) for o in r for c in o.outputs)

def timed(fn, seed):
    torch.cuda.synchronize(); t = time.perf_counter(); n = fn(seed); torch.cuda.synchronize()
    return n, time.perf_counter() - t

ours(0)  # warm-up
res = {}
for v in a.variants:
    runs = []
    for r in range(a.rounds if v in ("ours", "vllm_lp", "vllm_nolp", "gcoff") else 1):
        seed = 1 + r
        if v == "ours":
            runs.append(timed(ours, seed))
        elif v == "vllm_lp":
            runs.append(timed(lambda s: vllm_gen(s, True), seed))
        elif v == "vllm_nolp":
            runs.append(timed(lambda s: vllm_gen(s, False), seed))
        elif v == "gcoff":
            gc.collect(); gc.disable()
            runs.append(timed(ours, seed)); gc.enable()
        elif v == "steps":
            eng = engine.llm.llm_engine; orig = eng.step; times = []
            def step():
                t = time.perf_counter(); o = orig(); times.append(time.perf_counter() - t); return o
            eng.step = step
            runs.append(timed(ours, seed)); eng.step = orig
            times.sort()
            res["steps_detail"] = {"n": len(times), "median_ms": 1e3 * times[len(times) // 2], "p90_ms": 1e3 * times[int(.9 * len(times))],
                                   "max_ms": 1e3 * times[-1], "sum_s": sum(times)}
        elif v == "cprof":
            pr = cProfile.Profile(); pr.enable(); runs.append(timed(ours, seed)); pr.disable()
            s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(40)
            s2 = io.StringIO(); pstats.Stats(pr, stream=s2).sort_stats("cumulative").print_stats(40)
            open(f"{a.out}_cprof.txt", "w").write(s.getvalue() + "\n\n" + s2.getvalue())
        elif v == "tprof":
            from torch.profiler import profile, ProfilerActivity
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                runs.append(timed(ours, seed))
            ka = prof.key_averages()
            busy = sum(e.self_device_time_total for e in ka if e.device_type.name == "CUDA" and not e.is_user_annotation) / 1e6
            res["tprof_detail"] = {"device_busy_s": busy}
            open(f"{a.out}_tprof.txt", "w").write(f"device busy {busy:.3f} s\n" + ka.table(sort_by="self_cuda_time_total", row_limit=30, max_name_column_width=70))
    res[v] = [{"tokens": n, "s": s, "tok_per_s": n / s} for n, s in runs]
    print(v, res[v], flush=True)
out.update(res)
json.dump(out, open(f"{a.out}.json", "w"), indent=1)
print(json.dumps(out, indent=1))
