"""HF-format checkpoints out of FSDP2 shards: a directory that `from_pretrained` and vLLM load as they are.

Each parameter is gathered one at a time and offloaded to CPU (torch.distributed.checkpoint's full state dict with
cpu_offload), so no GPU ever holds more than one full tensor; rank 0 writes safetensors, config and tokenizer.
"""

import os
import shutil

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict


def save_hf_checkpoint(model: torch.nn.Module, tokenizer, path: str) -> None:
    """Collective: every rank calls it. Writes atomically: a killed save never leaves a half directory at `path`."""
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() == 0:
        # Saved in the checkpoint's own dtype (bf16 for most hub models), fp32 for the built-in tiny model.
        dtype = getattr(model.config, "dtype", None) or torch.float32
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype)
        state = {k: v.to(dtype) for k, v in state.items()}
        tmp = path.rstrip("/") + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(tmp, state_dict=state)
        tokenizer.save_pretrained(tmp)
        shutil.rmtree(path, ignore_errors=True)
        os.replace(tmp, path)
    dist.barrier()
