"""A model's KV cache in vLLM, decided before the engine starts: its size for a rollout's sequences (the rule itself,
with the share of the GPU it may take and the sleep level, is common/run/gpus.py's, which the planner forecasts
with) and the tensor-parallel widths vLLM's cache write cannot take. Imports nothing of vLLM.
"""

import torch

from common.run.gpus import kv_cache_size_gib


def kv_heads_per_rank(config, tp_size: int) -> tuple[int, int]:
    """(kv heads, head dim) of one tensor-parallel rank: at least one head, as vLLM copies kv heads when tp_size
    exceeds them."""
    config = config.get_text_config()  # the language model's, in a multimodal config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = max(1, (getattr(config, "num_key_value_heads", None) or config.num_attention_heads) // tp_size)
    return kv_heads, head_dim


def check_kv_width(config, tp_size: int) -> None:
    """One line, before vLLM starts, for a model whose keys take fewer than 32 values a token on a rank.

    vLLM 0.26.0's KV-cache write (reshape_and_cache_flash, FlashAttention's cache layout) runs min(kv heads x head
    dim, 512) threads per token and steps over the heads by whole warps of 32: with fewer threads than a warp the
    step is zero and the kernel never returns, the GPU at 100%. Seen on H200s with tiny random models (1 kv head of
    dim 16 on a rank: at --rollout-tp 2, or one GPU); every released model has head dims of 64 or more.
    """
    kv_heads, head_dim = kv_heads_per_rank(config, tp_size)
    if kv_heads * head_dim < 32:
        raise ValueError(f"--rollout-tp {tp_size}: each rank would hold {kv_heads} kv head(s) of dimension {head_dim}, "
                         f"{kv_heads * head_dim} values a token, and vLLM's KV-cache write never finishes below 32 (its "
                         f"loop steps over heads by whole warps): use a smaller --rollout-tp, or a model with more kv "
                         f"heads or a larger head_dim")


def kv_cache_gib(config, dtype: torch.dtype, tp_size: int, sequences: int, max_model_len: int,
                 device_gib: float) -> float:
    """GiB of KV cache per GPU for `sequences` sequences of up to max_model_len tokens at once, plus a tenth.

    Per token and rank: keys and values of every layer, for this rank's kv heads (kv_heads_per_rank). Exact for
    dense attention, an overestimate for sliding windows or latent attention. At least 0.5 GiB, at most KV_CACHE_CAP
    of the GPU (common/run/gpus.py).
    """
    kv_heads, head_dim = kv_heads_per_rank(config, tp_size)
    bytes_per_token = 2 * config.get_text_config().num_hidden_layers * kv_heads * head_dim * dtype.itemsize
    return kv_cache_size_gib(bytes_per_token, sequences, max_model_len, device_gib)
