"""LoRA (Hu et al. 2021, https://arxiv.org/abs/2106.09685): train low-rank adapters on a frozen base model, through
peft, so that RL on a 7-8B model fits one GPU.

Each targeted linear layer W of the decoder computes W x + (alpha / r) B A x, with A [r, in] drawn at random and
B [out, r] zero at the start, so the first forward pass is exactly the base model's. Only A and B train: the base
weights are frozen and kept in the compute dtype (no fp32 master copy, no gradients, no optimizer moments), the
training state holds the adapters alone, and the reference policy (GRPO's and PPO's KL, DPO's log-probs when not
cached) is the same model with its adapters switched off (`adapters_off`): no second copy of the model. How the
rollout engine gets the adapters (merged into the base weights, the default, or as adapters through vLLM's LoRA
layers: --lora-sync) is in sharding/lora.py, sharding/vllm_lora.py and common/rollout/vllm_engine.py; exports are a PEFT
adapter directory (sharding/checkpoint.py).

The learning rate: LoRA wants about ten times full fine-tuning's, and with alpha fixed (not scaled with the rank)
that does not move much with the rank (Schulman and Thinking Machines, "LoRA Without Regret", 2025): an unset --lr
with LoRA is 10x the script's full fine-tuning default.
"""

import contextlib
from dataclasses import dataclass
from typing import Literal

import torch

from common.train.model import decoder_layers
from sharding.lora import is_lora_layer, is_trained_weight, lora_layers

LORA_LR_SCALE = 10  # an unset --lr with LoRA: this times full fine-tuning's default (see the module docstring)


def default_lr(full_fine_tuning: float, args) -> float:
    """A script's default learning rate: full fine-tuning's, or LORA_LR_SCALE times it with --lora-rank."""
    return full_fine_tuning * (LORA_LR_SCALE if args.lora_rank else 1)


@dataclass
class LoraArgs:
    """The LoRA flags every script shares (each script's Args extends it)."""
    lora_rank: int = 0
    """LoRA: train rank-R adapters on the --lora-targets layers of a frozen base model (0: full fine-tuning). The
    base weights take no gradients and no optimizer moments, the reference policy is the base itself (adapters off),
    and states and exports hold the adapters alone (a 7B model's GRPO fits one 80 GB GPU at rank 32). Learning rate:
    about 10x full fine-tuning's (an unset --lr is that), nearly independent of the rank at a fixed --lora-alpha.
    Measured on SmolLM2-135M at rank 32 (benchmarks/README.md, LoRA): DPO on HH-RLHF at 10x (5e-5) ended at 0.628
    held-out preference accuracy against full fine-tuning's 0.593; GRPO on addition wants more: at 30x (3e-4) it
    ended 0.037 below full fine-tuning's held-out accuracy at step 30 (0.802 against 0.839, mean of 3 seeds), at 10x
    0.06-0.15 below. For RL, pass --lr at 10-30x full fine-tuning's"""
    lora_alpha: float = 32.0
    """LoRA's scale: the adapters' output is multiplied by alpha / rank (fixed alpha: the learning rate carries over
    between ranks)"""
    lora_targets: list[str] | None = None
    """the decoder's linear layers that get adapters, by name (e.g. q_proj v_proj); unset: every linear layer of
    attention and MLP"""
    lora_sync: Literal["merged", "adapter"] = "merged"
    """how colocated vLLM gets the adapters before each rollout: merged into the base weights and streamed like full
    fine-tuning's weights, or as adapters alone through vLLM's LoRA layers (the base loaded once, then 161 MB a
    step at 7B and rank 32; bf16 only). At the 7B shape on one H100 merged synced in 0.13 s against 0.29 s and
    decoded 10.5k tokens/s against 3.9k (eager vLLM; benchmarks/README.md, LoRA): merged is the default"""
    export_merged: bool = False
    """with LoRA: each HF export also holds the adapters merged into the base, a full model, in hf_step_N/merged"""

    fixed_on_resume = ("lora_rank", "lora_alpha", "lora_targets")  # flags a resumed run keeps


def check_lora_args(args) -> None:
    """One line for LoRA flags that cannot work (before any model is loaded)."""
    if args.lora_rank < 0:
        raise ValueError(f"--lora-rank must be at least 0 (0: full fine-tuning), got {args.lora_rank}")
    if args.lora_alpha <= 0:
        raise ValueError(f"--lora-alpha must be greater than 0, got {args.lora_alpha}")
    if not args.lora_rank:
        for name in ("lora_targets", "export_merged"):
            if getattr(args, name):
                raise ValueError(f"--{name.replace('_', '-')} needs --lora-rank (LoRA is off)")
        if args.lora_sync != "merged":
            raise ValueError("--lora-sync needs --lora-rank (LoRA is off)")
    if args.lora_sync == "adapter" and (getattr(args, "rollout_ranks", 0) or getattr(args, "rollout_engine", "")
                                        != "vllm"):
        raise ValueError("--lora-sync adapter needs vLLM colocated with the trainer (split placement's rollout ranks "
                         "and the hf engine take merged weights)")
    if args.lora_sync == "adapter" and getattr(args, "precision", "bf16") == "fp32":
        raise ValueError("--lora-sync adapter: vLLM's LoRA kernels take bf16 or fp16 inputs only (--precision auto is "
                         "fp32 for models under 0.3B parameters); add --precision bf16, or use --lora-sync merged")
    if args.lora_rank and getattr(args, "ref_update_every", 0):  # dpo.py's iterative DPO
        raise ValueError("--ref-update-every does not combine with --lora-rank: a LoRA run's reference is its base "
                         "model (the adapters switched off), which does not move")
    if args.lora_targets is not None and not args.lora_targets:
        raise ValueError("--lora-targets names no layer; leave it unset for every linear layer of attention and MLP")


def linear_layer_names(model: torch.nn.Module) -> list[str]:
    """The names of the linear layers inside the model's decoder layers (q_proj, k_proj, ..., down_proj), sorted; an
    adapted one counts once, by its own name."""
    return sorted({name.rsplit(".", 1)[-1] for layer in decoder_layers(model) for name, module in layer.named_modules()
                   if (isinstance(module, torch.nn.Linear) or is_lora_layer(module))
                   and ".base_layer" not in name and ".lora_" not in name})


def add_lora(model: torch.nn.Module, args, seed: int, heads: tuple[str, ...] = ()) -> torch.nn.Module:
    """With --lora-rank R > 0: adapters of rank R on every --lora-targets layer of the decoder, injected in place
    (the model stays the same HF class, its adapted layers become peft's lora.Linear), and every weight but the
    adapters' (and the `heads`, e.g. a critic's value head) frozen. A draws from `seed` alone, so every rank builds
    the same adapters without touching the global random stream (peft makes them in the base's dtype: on a base read
    in bf16 (read_dtypes), A's draw is rounded to bf16, and shard_model keeps them in fp32 from there). The config
    lands in model.peft_config["default"], with the heads as its modules_to_save, for the exports. Without LoRA: the
    model unchanged."""
    if not args.lora_rank:
        return model
    from peft import LoraConfig, inject_adapter_in_model

    available = linear_layer_names(model)
    targets = args.lora_targets or available
    if missing := sorted(set(targets) - set(available)):
        raise ValueError(f"--lora-targets {' '.join(missing)}: {type(model).__name__}'s decoder layers have no such "
                         f"linear layer; they have {' '.join(available)}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        inject_adapter_in_model(LoraConfig(r=args.lora_rank, lora_alpha=args.lora_alpha, target_modules=sorted(targets),
                                           lora_dropout=0.0, bias="none"), model)
    model.requires_grad_(False)
    for name, param in model.named_parameters():
        if is_trained_weight(name, heads):
            param.requires_grad_(True)
    config = model.peft_config["default"]  # what the exports write: the base model, the task, the value head
    config.base_model_name_or_path = model.name_or_path or None
    config.task_type = "TOKEN_CLS" if type(model).__name__.endswith("ForTokenClassification") else "CAUSAL_LM"
    config.modules_to_save = list(heads) or None
    return model


@contextlib.contextmanager
def adapters_off(model: torch.nn.Module | None):
    """Within it, every adapted layer of `model` computes its base layer alone: the model is the base model, the
    reference policy of a LoRA run. A model without adapters (or None) is left as it is. peft's own switch
    (enable_adapters) also clears the adapters' requires_grad, which FSDP2 would carry into the unsharded
    parameters it builds at its first all-gather, so the flag is set directly."""
    layers = [] if model is None else lora_layers(model)
    for layer in layers:
        layer._disable_adapters = True
    try:
        yield
    finally:
        for layer in layers:
            layer._disable_adapters = False

