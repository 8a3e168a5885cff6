"""HF-format checkpoints out of FSDP2 shards: a directory that `from_pretrained` and vLLM load as they are.

Each parameter is gathered one at a time and offloaded to CPU (torch.distributed.checkpoint's full state dict with
cpu_offload), so no GPU ever holds more than one full tensor; rank 0 writes safetensors, config and tokenizer.
"""

import json
import os
import shutil

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict


def save_hf_checkpoint(model: torch.nn.Module, tokenizer, path: str, dtype: torch.dtype) -> None:
    """Collective: every rank calls it. Saves the weights in `dtype` (the original checkpoint's, usually bf16;
    the trainer's master weights are fp32). Atomic: a killed save never leaves a half directory at `path`."""
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() == 0:
        state = {k: v.to(dtype) for k, v in state.items()}
        tmp = path.rstrip("/") + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(tmp, state_dict=state)
        tokenizer.save_pretrained(tmp)
        # save_pretrained records the dtype of the (fp32) live parameters; the files hold `dtype`.
        config_path = os.path.join(tmp, "config.json")
        with open(config_path) as f:
            config = json.load(f)
        config["dtype"] = str(dtype).removeprefix("torch.")
        with open(config_path, "w") as f:
            json.dump(config, f, indent=2)
        shutil.rmtree(path, ignore_errors=True)
        os.replace(tmp, path)
    dist.barrier()
