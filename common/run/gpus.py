"""The GPU kinds nanorl knows, by a substring of the device's name: dense bf16 tensor-core FLOP/s (the peak MFU is
measured against, common/run/perf.py), HBM bandwidth (bytes/s) and memory (GB of 1e9 bytes, as torch.cuda.mem_get_info
and perf/peak_memory_gb count them), both the capacity planner's (common/run/planner.py)."""

GPUS = {  # kind: (bf16 FLOP/s, bandwidth, memory_gb)
    "H100": (989e12, 3.35e12, 85.0),
    "H200": (989e12, 4.8e12, 150.0),
    "A100": (312e12, 2.0e12, 85.0),
    "H800": (989e12, 3.35e12, 85.0),  # the H100 and A100 as sold in China: their compute and memory
    "A800": (312e12, 2.0e12, 85.0),
}
