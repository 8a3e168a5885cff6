"""HF-format checkpoints out of FSDP2 shards: a directory that `from_pretrained` and vLLM load as they are.

Each parameter is gathered one at a time and offloaded to CPU (torch.distributed.checkpoint's full state dict with
cpu_offload), so no GPU ever holds more than one full tensor; rank 0 writes safetensors, config and tokenizer, and
checks that the tokenizer reads back, as our scripts load a --model (`load_saved_tokenizer`, which
common.train.model.load_tokenizer calls), as the one that trained (transformers picks a tokenizer class by model type, which
for some types ignores the saved tokenizer: the model would then load with other token ids).
A LoRA model (sharding/lora.py) is exported as PEFT's adapter directory (its adapters alone, a few MB), or merged
into the base architecture, a full model.
"""

import json
import os
import shutil

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from transformers import AutoConfig, AutoTokenizer, PreTrainedTokenizerFast

from sharding.lora import merged_state_dict, save_peft_adapter, scalings


def checkpoint_dtype(model: str | None) -> torch.dtype:
    """The dtype a checkpoint was published in (exports are written in it); fp32 for the built-in tiny model."""
    dtype = None if model is None else AutoConfig.from_pretrained(model).dtype
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    return dtype or torch.float32


def saved_as_plain_backend(path: str) -> bool:
    config = os.path.join(path, "tokenizer_config.json")
    if not os.path.isfile(config):
        return False
    with open(config) as f:
        return json.load(f).get("tokenizer_class") in ("TokenizersBackend", "PreTrainedTokenizerFast")


def load_saved_tokenizer(path: str):
    """The tokenizer of an HF model (hub id or directory), as it was saved. Defined here, beside the export that
    must read back, and used by common.train.model.load_tokenizer, so that the check below loads as the scripts do."""
    tokenizer = AutoTokenizer.from_pretrained(path)
    if saved_as_plain_backend(path) and type(tokenizer).__name__ != "TokenizersBackend":
        # Saved as a plain tokenizers pipeline (e.g. a word-level one), which AutoTokenizer would rebuild as the
        # model type's own class (a qwen2 config gives Qwen2Tokenizer's BPE, splitting words into digits): load the
        # pipeline as it was saved.
        tokenizer = PreTrainedTokenizerFast.from_pretrained(path)
    return tokenizer


def check_tokenizer_round_trip(tokenizer, path: str, probes: list[str]) -> None:
    """Raises if the tokenizer saved in `path`, loaded as a --model's is (load_saved_tokenizer: AutoTokenizer, or the
    saved pipeline where AutoTokenizer would rebuild it as the model type's own class), encodes `probes` differently
    from `tokenizer`."""
    loaded = load_saved_tokenizer(path)
    for text in probes:
        if loaded(text)["input_ids"] != tokenizer(text)["input_ids"]:
            raise ValueError(f"the tokenizer saved in {path} loads back as {type(loaded).__name__}, which encodes "
                             f"{text[:60]!r} differently from the {type(tokenizer).__name__} that trained")


def save_hf_checkpoint(model: torch.nn.Module, tokenizer, path: str, dtype: torch.dtype,
                       probes: tuple[str, ...] = ("Hello, world! 12 + 34 = 46",), adapter: bool = False) -> None:
    """Collective: every rank calls it. Saves the weights in `dtype` (the original checkpoint's, usually bf16;
    the trainer's master weights are fp32). Atomic: a killed save never leaves a half directory at `path`.
    probes: texts the saved tokenizer must encode as `tokenizer` does (a few of the run's prompts).
    A LoRA model: merged (W + s B A), or with `adapter` PEFT's adapter directory (only the trained weights are
    gathered), for `PeftModel.from_pretrained(base, path)` and vLLM's LoRARequest."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=adapter)
    state = get_model_state_dict(model, options=options)
    error = None
    if dist.get_rank() == 0:
        tmp = path.rstrip("/") + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        if adapter:
            save_peft_adapter(state, model.peft_config["default"], tmp, dtype)
        else:
            state = {k: v.to(dtype) for k, v in merged_state_dict(state, scalings(model)).items()}
            model.save_pretrained(tmp, state_dict=state)
            # save_pretrained records the dtype of the (fp32) live parameters; the files hold `dtype`.
            config_path = os.path.join(tmp, "config.json")
            with open(config_path) as f:
                config = json.load(f)
            config["dtype"] = str(dtype).removeprefix("torch.")
            with open(config_path, "w") as f:
                json.dump(config, f, indent=2)
        tokenizer.save_pretrained(tmp)
        try:
            check_tokenizer_round_trip(tokenizer, tmp, list(probes))
        except (OSError, ValueError) as e:  # it encodes differently, or transformers cannot read it back at all
            error = e
        shutil.rmtree(path, ignore_errors=True)
        os.replace(tmp, path)
    # Every rank stops with rank 0's verdict, or the others would wait forever in their next collective. As a
    # ValueError it is a user error (common/run/errors.py): one line, the same whichever rank gets to report it.
    verdict = [None if error is None else str(error)]
    dist.broadcast_object_list(verdict, src=0)  # also the barrier: no rank goes on before the export is in place
    if error is not None:
        raise error
    if verdict[0] is not None:
        raise ValueError(verdict[0])
