"""The GPU kinds nanorl knows, by a substring of the device's name: dense bf16 tensor-core FLOP/s (the peak MFU is
measured against, common/run/perf.py), HBM bandwidth (bytes/s) and memory (GB of 1e9 bytes, as torch.cuda.mem_get_info
and perf/peak_memory_gb count them), both the capacity planner's (common/run/planner.py). Below, the shares of a GPU
that vLLM's defaults take: common/rollout/vllm_engine.py applies them, the planner forecasts with them."""

import math

GPUS = {  # kind: (bf16 FLOP/s, bandwidth, memory_gb)
    "H100": (989e12, 3.35e12, 85.0),
    "H200": (989e12, 4.8e12, 150.0),
    "A100": (312e12, 2.0e12, 85.0),
    "H800": (989e12, 3.35e12, 85.0),  # the H100 and A100 as sold in China: their compute and memory
    "A800": (312e12, 2.0e12, 85.0),
}

KEEP_WEIGHTS_UP_TO = 0.15  # sleep_level None: level 0 while vLLM's weights take at most this share of the GPU
KV_CACHE_CAP = 0.4  # the default KV cache takes at most this share of the GPU (vLLM then queues the rest)


def kv_cache_size_gib(bytes_per_token: float, sequences: float, max_model_len: int, device_gib: float) -> float:
    """The size of common/rollout/vllm_engine.py's kv_cache_gib (and the planner's): `sequences` in blocks of 16
    tokens, a tenth more, at least 0.5 GiB, at most KV_CACHE_CAP of the GPU."""
    tokens = sequences * math.ceil(max_model_len / 16) * 16  # vLLM's blocks hold 16 tokens
    return min(max(0.5, 1.1 * tokens * bytes_per_token / 2**30), KV_CACHE_CAP * device_gib)


def default_sleep_level(weight_bytes: int, device_bytes: int, keep_weights: bool = False) -> int:
    """0 (weights stay on the GPU) when they take at most KEEP_WEIGHTS_UP_TO of it, else 2 (dropped), or with
    keep_weights (a base loaded once) 1 (parked in CPU memory)."""
    return 0 if weight_bytes <= KEEP_WEIGHTS_UP_TO * device_bytes else 1 if keep_weights else 2
