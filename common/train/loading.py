"""A run's models as every script loads them: the policy that trains (with --lora-rank, adapters on a frozen base),
PPO's critic, and frozen models beside them (a reference, a reward model), each sharded with FSDP2.

A checkpoint is read in the dtype its weights are kept in (read_dtypes): a frozen model in the compute dtype on a
GPU, the policy's trained weights in fp32, their master copy.
"""

import torch

from common.train.lora import add_lora
from common.train.model import load_model, read_dtypes, shard_model
from common.train.value_models import load_critic, load_reward_model


def load_policy(args, tokenizer, device: torch.device, packed_rows: bool = False) -> torch.nn.Module:
    """--model to train, with --lora-rank's adapters, sharded with the run's activation checkpointing, compilation,
    precision and (mixture of experts) load-balancing term. packed_rows: it never generates with HF's generate."""
    trained_dtype, _ = read_dtypes(device, args.precision, args.lora_rank)
    model = add_lora(load_model(args.model, tokenizer, args.seed, dtype=trained_dtype), args, args.seed)
    return shard_model(model, device, activation_checkpointing=args.activation_checkpointing,
                       compile_layers=args.compile, precision=args.precision, packed_rows=packed_rows,
                       router_aux_loss_coef=args.router_aux_loss_coef)


def load_critic_model(args, tokenizer, device: torch.device) -> torch.nn.Module:
    """PPO's critic (--critic-model, else --model with a value head: value_models.load_critic), with --lora-rank's
    adapters on its base and its value head trained in full, sharded like the policy."""
    trained_dtype, _ = read_dtypes(device, args.precision, args.lora_rank)
    critic = load_critic(args.model, args.critic_model, tokenizer, args.seed, trained_dtype)
    return shard_model(add_lora(critic, args, args.seed, heads=("score",)), device,
                       activation_checkpointing=args.activation_checkpointing, compile_layers=args.compile,
                       precision=args.precision, packed_rows=True)  # (it never generates)


def load_reference(args, tokenizer, device: torch.device) -> torch.nn.Module:
    """A frozen copy of --model as it starts: the reference of a KL penalty or of DPO's implicit reward."""
    _, frozen_dtype = read_dtypes(device, args.precision, args.lora_rank)
    return shard_frozen(load_model(args.model, tokenizer, args.seed, dtype=frozen_dtype), args, device)


def load_frozen_reward_model(args, device: torch.device):
    """(--reward-model, frozen and sharded; its tokenizer)."""
    _, frozen_dtype = read_dtypes(device, args.precision, args.lora_rank)
    model, tokenizer = load_reward_model(args.reward_model, frozen_dtype)
    return shard_frozen(model, args, device), tokenizer


def shard_frozen(model: torch.nn.Module, args, device: torch.device) -> torch.nn.Module:
    return shard_model(model, device, trainable=False, compile_layers=args.compile, precision=args.precision,
                       packed_rows=True)
