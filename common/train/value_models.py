"""Models with a scalar head: PPO's critic and a reward model, run on packed rows like the policy's log-probs.

- The critic is the policy's transformer body with a `Linear(hidden, 1)` head (transformers' *ForTokenClassification
  with one label): its value at the position before each response token estimates the return from there. It
  starts from the policy's weights, or from another checkpoint: a causal LM (the head starts afresh) or a
  sequence-classification reward model, whose score head becomes the value head.
- A reward model (*ForSequenceClassification, one label, frozen) scores each whole response once, reading its head
  at the sequence's last token. If its tokenizer differs from the policy's, the text is re-tokenized for it.
Both are FSDP2-sharded like the policy (common/train/model.py) and computed in packed token-budget micro-batches.
"""

import torch

from common.train.batching import pack_sequences, plan_equal_micro_batches
from common.train.logprobs import attach_forward_method, sample_lengths
from common.train.model import check_model_source, from_pretrained, load_model
from common.train.sequence_parallel import gather_scored, local_part, sequence_parallel_size
from common.train.tiny_model import tiny_model_config


def load_critic(model: str | None, critic_model: str | None, tokenizer, seed: int,
                dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The critic in `dtype` (a LoRA run's frozen base: read_dtypes) on CPU for shard_model (see the module docstring
    for where its weights come from; a checkpoint is read by rank 0 alone, common/train/model.from_pretrained). Raises
    a one-line error for a critic checkpoint that cannot serve this policy."""
    from transformers import AutoConfig, AutoModelForTokenClassification

    if critic_model is not None:
        check_model_source(critic_model, "--critic-model")
        config, policy_config = AutoConfig.from_pretrained(critic_model), _policy_config(model, tokenizer)
        for name in ("vocab_size", "hidden_size"):
            if getattr(config, name, None) != getattr(policy_config, name, None):
                raise ValueError(f"--critic-model {critic_model}: its {name} is {getattr(config, name, None)}, the "
                                 f"policy's {getattr(policy_config, name, None)}; the critic reads the policy's tokens "
                                 f"and must be the same kind of model")
    source = critic_model or model
    if source is None:  # the built-in tiny model: its random body, the same as the policy's (same seed)
        policy = load_model(None, tokenizer, seed)
        config = policy.config.__class__.from_dict({**policy.config.to_dict(), "num_labels": 1})
        critic = AutoModelForTokenClassification.from_config(config, dtype=torch.float32)
        critic.base_model.load_state_dict(policy.base_model.state_dict())
    else:
        try:
            critic = from_pretrained(AutoModelForTokenClassification, source, dtype=dtype, num_labels=1)
        except ValueError as e:  # an architecture without a token-classification class
            raise ValueError(f"cannot build a critic from {source}: {' '.join(str(e).split())[:200]}") from e
    # A new head starts at zero: every value 0, so the first advantages are the rewards themselves, not the noise of
    # a random projection of hidden states (whose norms in a real model make that noise as large as the rewards).
    # A reward model's score head is kept: it already scores responses (it has no bias: that one starts at 0).
    from_reward_model = critic_model is not None and any(
        a.endswith("ForSequenceClassification") for a in getattr(AutoConfig.from_pretrained(critic_model),
                                                                 "architectures", None) or [])
    with torch.no_grad():
        if not from_reward_model:
            critic.score.weight.zero_()
        if critic.score.bias is not None:
            critic.score.bias.zero_()
    return critic


def _policy_config(model: str | None, tokenizer):
    from transformers import AutoConfig

    if model is None:
        return tiny_model_config(tokenizer)
    return AutoConfig.from_pretrained(model)


def load_reward_model(path: str, dtype: torch.dtype = torch.float32):
    """(reward model in `dtype` (read_dtypes) on CPU, its tokenizer); one clear line for a checkpoint that is not a
    one-label sequence classifier."""
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    check_model_source(path, "--reward-model")
    config = AutoConfig.from_pretrained(path)
    architectures = getattr(config, "architectures", None) or []
    if not any(a.endswith("ForSequenceClassification") for a in architectures):
        raise ValueError(f"--reward-model {path}: not a sequence-classification model (its architectures: "
                         f"{architectures}); a reward model scores a whole response with one number")
    if config.num_labels != 1:
        raise ValueError(f"--reward-model {path}: it has {config.num_labels} labels, a reward model has one")
    model = from_pretrained(AutoModelForSequenceClassification, path, dtype=dtype)
    return model, AutoTokenizer.from_pretrained(path)


def _packed_scalar_forward(self, input_ids, position_ids, index, attention_kwargs: dict):
    """A forward of the root module (see packed_scalars), so FSDP gathers the head's weight."""
    hidden = self.base_model(input_ids=input_ids, position_ids=position_ids, use_cache=False,
                             **attention_kwargs).last_hidden_state  # [1, total, d]
    return self.score(hidden[0, index]).squeeze(-1).float()  # no dropout: the head reads hidden states as they are


def packed_scalars(model, packed: dict, index: torch.Tensor) -> torch.Tensor:
    """The scalar head's output [len(index)] at the given positions of a packed row (common/train/batching.py); with
    sequence parallelism each rank reads its slice's positions and the group gathers them."""
    counts = None
    if sequence_parallel_size() > 1:
        packed, index, _, counts = local_part(packed, index)
    device, attention_kwargs = attach_forward_method(model, "packed_scalar_forward", _packed_scalar_forward, packed)
    scalars = model.packed_scalar_forward(packed["input_ids"].to(device), packed["position_ids"].to(device),
                                          index.to(device), attention_kwargs)
    return scalars if counts is None else gather_scored(scalars, counts)


def packed_values(critic, samples: list[dict]) -> list[torch.Tensor]:
    """The critic's value of the state before each response token of each sample ([len(response)] each), from one
    packed forward. An empty `samples` runs a dummy sequence (a rank's zero-weight filler pass)."""
    packed = pack_sequences([s["prompt_ids"] + s["response_ids"] for s in samples],
                            [len(s["response_ids"]) for s in samples] if samples else None)
    return list(packed_scalars(critic, packed, packed["target_index"]).split(packed["num_scored"]))


@torch.no_grad()
def compute_values(critic, samples: list[dict], max_tokens: int, device) -> list[torch.Tensor]:
    """Collective: packed_values of every sample, in micro-batches, as float32 on CPU."""
    out = [None] * len(samples)
    for mb in plan_equal_micro_batches(sample_lengths(samples), max_tokens, device):  # empty mb: a dummy pass
        for i, values in zip(mb, packed_values(critic, [samples[i] for i in mb])):
            out[i] = values.float().cpu()
    critic.reshard()
    return out


@torch.no_grad()
def reward_model_scores(reward_model, rm_tokenizer, tokenizer, samples: list[dict], max_tokens: int,
                        device) -> list[float]:
    """Collective: the reward model's score of each whole sample (prompt + response), read at its last token."""
    same_tokens = rm_tokenizer.get_vocab() == tokenizer.get_vocab()
    sequences = [s["prompt_ids"] + s["response_ids"] for s in samples]
    if not same_tokens:  # another tokenizer: the same text in its tokens
        texts = tokenizer.batch_decode(sequences, skip_special_tokens=False)
        sequences = [ids for ids in rm_tokenizer(texts, add_special_tokens=False)["input_ids"]]
    out = [0.0] * len(samples)
    for mb in plan_equal_micro_batches([len(ids) for ids in sequences], max_tokens, device):
        packed = pack_sequences([sequences[i] for i in mb], [0] * len(mb) if mb else None)
        last = packed["cu_seqlens"][1:].long() - 1  # each sequence's last token
        scores = packed_scalars(reward_model, packed, last)
        for i, score in zip(mb, scores.tolist()):
            out[i] = score
    reward_model.reshard()
    return out
