"""Where the in-loop sync's wake-up goes, and what reordering it could save (scratch profile, one GPU).

torchrun --standalone --nproc_per_node 1 dev/prof_wake.py SHAPE GPU_MEMORY ITERS OUT.json   (from the repo root; run
as a copy in the repo root for benchmarks/results/sync_level0_kv_sized_1xh200/profile_wake_*.json)

Variants on one engine (level-2 sleep unless said): "current" the sync as update_weights made it before level 0, each
part timed; "overlap" the KV cache mapped while the transfer's copies run; "kv_only" and "kv_only_serial" only the KV
cache freed, mapped during / after the transfer; "maps" the two wake-ups alone. Written before level 0 existed in
common/rollout/vllm_engine.py, which now does what kv_only_serial does.
"""
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root holds common/, scripts/ and sharding/
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # bench_sync.py
from bench_sync import build_policy, save_config
from common.rollout.vllm_engine import VLLMRolloutEngine
from common.run.distributed import init_distributed
from scripts.random_model import qwen2_config
from sharding.vllm_sync import buckets, num_bytes, trainer_weights

shape, gpu_mem, iters, out = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
rank, world, device = init_distributed()
config = qwen2_config(shape)
d = save_config(config, f"/tmp/pw_{shape}", rank)
policy = build_policy(config, device, torch.bfloat16)
eng = VLLMRolloutEngine(d, 1, gpu_mem, 1024, [], 0, enforce_eager=True, sleep_level=2)
eng.update_weights(policy)
llm = eng.llm
from vllm.device_allocator.cumem import CuMemAllocator, create_and_map, unmap_and_release

alloc = CuMemAllocator.get_instance()
tags = {}
for ptr, data in alloc.pointer_to_data.items():
    n, b = tags.get(data.tag, (0, 0))
    tags[data.tag] = (n + 1, b + data.handle[1])
kv_cfg = llm.llm_engine.vllm_config.cache_config
res = {"shape": shape, "gpu_mem": gpu_mem, "allocations": {t: {"count": n, "gb": b / 1e9} for t, (n, b) in tags.items()},
       "num_gpu_blocks": kv_cfg.num_gpu_blocks, "variants": {}}
print(res, flush=True)


def now():
    torch.cuda.synchronize()
    return time.perf_counter()


def bump():
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(1e-2)
    torch.cuda.synchronize()


def issue():
    for bucket in buckets(trainer_weights(policy, eng.vllm_model, torch.bfloat16), lambda it: num_bytes(it[1]),
                          512 * 2**20):
        eng.vllm_model.load_weights(bucket)


def tagged(tag):
    return [data for data in alloc.pointer_to_data.values() if data.tag == tag]


def kv_sleep():
    for data in tagged("kv_cache"):
        unmap_and_release(data.handle)
        data.is_asleep = True


def kv_wake():
    for data in tagged("kv_cache"):
        create_and_map(data.handle)
        data.is_asleep = False


def run(name, body):
    rows = []
    for _ in range(iters):
        bump()
        rows.append(body())
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    res["variants"][name] = {"median": med, "rows": rows}
    print(name, {k: round(v, 4) for k, v in med.items()}, flush=True)


def pure():
    t0 = now(); issue(); t1 = now(); llm.reset_prefix_cache(); t2 = now()
    return {"transfer": t1 - t0, "reset": t2 - t1}


def current():  # what update_weights does after a level-2 sleep, each part timed
    t0 = now(); llm.sleep(level=2); t1 = now()
    torch.cuda.empty_cache(); t2 = now()
    llm.wake_up(tags=["weights"]); t3 = now()
    issue(); t4 = now()
    torch.cuda.empty_cache(); t5 = now()
    llm.wake_up(tags=["kv_cache"]); t6 = now()
    llm.reset_prefix_cache(); t7 = now()
    return {"sleep": t1 - t0, "empty1": t2 - t1, "wake_w": t3 - t2, "transfer": t4 - t3, "empty2": t5 - t4,
            "wake_kv": t6 - t5, "reset": t7 - t6, "in_loop": t7 - t1}


def overlap():  # level 2, KV mapped while the transfer's copies run, no second reset
    t0 = now(); llm.sleep(level=2); t1 = now()
    torch.cuda.empty_cache(); llm.wake_up(tags=["weights"]); t3 = now()
    issue(); tq = time.perf_counter()
    llm.wake_up(tags=["kv_cache"]); tk = time.perf_counter(); t6 = now()
    return {"sleep": t1 - t0, "wake_w": t3 - t1, "issue_host": tq - t3, "wake_kv_host": tk - tq, "after": t6 - t3,
            "in_loop": t6 - t1}


def kv_only():  # weights stay mapped through training, only the KV cache is freed
    t0 = now(); llm.reset_prefix_cache(); kv_sleep(); torch.cuda.empty_cache(); t1 = now()
    issue(); tq = time.perf_counter(); kv_wake(); tk = time.perf_counter(); t6 = now()
    return {"sleep": t1 - t0, "issue_host": tq - t1, "wake_kv_host": tk - tq, "in_loop": t6 - t1}


def kv_only_serial():
    t0 = now(); llm.reset_prefix_cache(); kv_sleep(); torch.cuda.empty_cache(); t1 = now()
    issue(); t2 = now(); kv_wake(); t3 = now()
    return {"sleep": t1 - t0, "transfer": t2 - t1, "wake_kv": t3 - t2, "in_loop": t3 - t1}


def weights_map_only():  # level 2 sleep, then wake all, without transfer: mapping rates per tag
    llm.sleep(level=2); t1 = now()
    llm.wake_up(tags=["weights"]); t2 = now(); llm.wake_up(tags=["kv_cache"]); t3 = now()
    return {"wake_w": t2 - t1, "wake_kv": t3 - t2}


for name, body in [("pure", pure), ("current", current), ("overlap", overlap), ("kv_only", kv_only),
                   ("kv_only_serial", kv_only_serial), ("pure_again", pure), ("maps", weights_map_only)]:
    run(name, body)
    if name != "maps":
        eng.check_weights(policy)
        res["variants"][name]["check_passed"] = True
# the engine still generates after the KV-only cycles and the level-2 ones
issue(); torch.cuda.synchronize()
outs = eng.generate([[1, 2, 3, 4]] * 4, n=2, max_tokens=16, temperature=1.0, top_p=1.0, seed=0, ignore_eos=True)
res["generate_ok"] = all(len(c.response_ids) == 16 for o in outs for c in o)
pure_t = res["variants"]["pure"]["median"]["transfer"]
for name in ("current", "overlap", "kv_only", "kv_only_serial"):
    res["variants"][name]["over_pure"] = res["variants"][name]["median"]["in_loop"] / pure_t
print({k: v.get("over_pure") for k, v in res["variants"].items()}, res["generate_ok"], flush=True)
json.dump(res, open(out, "w"), indent=1)
