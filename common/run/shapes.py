"""A decoder's sizes for the capacity planner (common/run/planner.py): its parameters, those a token computes with,
LoRA's and the KV cache's bytes, read from a transformers config.

Mixtures of experts (Qwen3-MoE, Qwen2-MoE, OLMoE, Mixtral): each layer's MLP is `experts` MLPs of `intermediate` each,
a router (hidden x experts) and, in Qwen2-MoE, a shared expert every token goes through. Memory holds every expert
(weights, gradients, moments, the gathered layers, vLLM's copy); a token computes with the top k only, so FLOPs,
the MFU's size and the prefill count the active parameters (all but the experts it skips). A layer keeps the
activations of k experts per token (as a dense MLP of k x intermediate) plus its routing: the hidden state copied into
each of its k experts and their outputs before the weighted sum, and the router's fp32 logits and probabilities.
Decoding reads every expert each engine step (a batch of many sequences touches nearly all of them: 1 - (1 - k /
experts)^sequences, over 99.9% at 8 of 128 and 110 sequences), so its time is that of the whole model, an upper bound
once few sequences are left. LoRA adapts the linear layers the decoder has: attention's projections and Qwen2-MoE's
shared expert (transformers holds the routed experts as 3-D parameters, not nn.Linear). Not modelled: layers left
dense (decoder_sparse_step > 1, mlp_only_layers), q/k norms and attention biases (as for dense Qwen2), the
per-expert kernel launches of transformers' expert loop, and experts' uneven loads. One mixture-of-experts run has
been measured against these (a 3.7B OLMoE shape): the activation coefficients are the dense fit's, and the MFU is a
dense model's times a fitted moe_share (common/run/planner.py).
"""

from dataclasses import dataclass

from sharding.vllm_moe import expert_count


@dataclass
class Shape:
    """A decoder's sizes (a transformers config's names) and its parameter count. A mixture of experts has experts > 0,
    experts_per_token of them active, each an MLP of `intermediate`, and maybe a shared expert (Qwen2-MoE)."""
    hidden: int
    intermediate: int  # the MLP's size, or each expert's
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    tied: bool
    head_dim: int = 0
    experts: int = 0  # 0: a dense model
    experts_per_token: int = 0
    shared_intermediate: int = 0  # Qwen2-MoE's shared expert

    def __post_init__(self):
        self.head_dim = self.head_dim or self.hidden // self.heads

    @classmethod
    def from_config(cls, config) -> "Shape":
        config = config.get_text_config() if hasattr(config, "get_text_config") else config
        experts = expert_count(config)
        # Qwen-MoE's intermediate_size is a dense MLP's (unused when every layer is sparse), its experts' their own
        expert_size = getattr(config, "moe_intermediate_size", None) if experts else None
        heads = config.num_attention_heads
        return cls(config.hidden_size, expert_size or config.intermediate_size, config.num_hidden_layers, heads,
                   getattr(config, "num_key_value_heads", None) or heads, config.vocab_size,
                   bool(getattr(config, "tie_word_embeddings", False)),
                   head_dim=getattr(config, "head_dim", None) or 0, experts=experts,
                   experts_per_token=getattr(config, "num_experts_per_tok", 0) if experts else 0,
                   shared_intermediate=(getattr(config, "shared_expert_intermediate_size", 0) or 0) if experts else 0)

    @property
    def layer_params(self) -> int:
        attention = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        if not self.experts:
            return attention + 3 * self.hidden * self.intermediate + 2 * self.hidden
        router = self.hidden * self.experts
        shared = 3 * self.hidden * self.shared_intermediate + self.hidden if self.shared_intermediate else 0  # + gate
        return attention + self.experts * self.expert_params + router + shared + 2 * self.hidden

    @property
    def expert_params(self) -> int:  # one expert of one layer: gate, up and down projections
        return 3 * self.hidden * self.intermediate

    @property
    def root_params(self) -> int:
        return self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden

    @property
    def params(self) -> int:
        return self.layers * self.layer_params + self.root_params

    @property
    def active_params(self) -> int:
        """The parameters one token computes with: all of a dense model's, a mixture's but the experts it skips."""
        return self.params - self.layers * (self.experts - self.experts_per_token) * self.expert_params

    @property
    def mlp_width(self) -> int:  # the MLP activations a token keeps per layer: its k experts' and the shared one's
        return self.experts_per_token * self.intermediate + self.shared_intermediate if self.experts else \
            self.intermediate

    def routing_bytes(self, compute: int) -> int:
        """Per token and layer, a mixture's routing buffers: its hidden state copied into each of its k experts and
        their outputs before the weighted sum (compute dtype), the router's logits and probabilities (fp32)."""
        return 2 * self.experts_per_token * self.hidden * compute + 8 * self.experts if self.experts else 0

    @property
    def kv_bytes_per_token(self) -> int:  # bf16 keys and values of every layer
        return 2 * self.layers * self.kv_heads * self.head_dim * 2

    def trained_and_frozen(self, lora_rank: int, active: bool = False) -> tuple[int, int]:
        """Parameters trained and frozen: all trained, or the adapters trained on a frozen base. active: only those a
        token computes with (what FLOPs count; memory holds them all)."""
        base = self.active_params if active else self.params
        return (self.lora_params(lora_rank), base) if lora_rank else (base, 0)

    def lora_params(self, rank: int) -> int:
        """Adapters of rank r on every linear layer of the decoder, r x (in + out) each: attention's and the MLP's; of
        a mixture, attention's and the shared expert's with its gate (the routed experts are not nn.Linear layers)."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        pairs = [(self.hidden, q), (self.hidden, kv), (self.hidden, kv), (q, self.hidden)]
        mlp = self.shared_intermediate if self.experts else self.intermediate
        if mlp:
            pairs += [(self.hidden, mlp), (self.hidden, mlp), (mlp, self.hidden)]
        if self.experts and self.shared_intermediate:
            pairs.append((self.hidden, 1))  # the shared expert's gate
        return self.layers * rank * sum(a + b for a, b in pairs)


def heads_split(heads: int, kv_heads: int, size: int) -> bool:
    """Whether attention splits over `size` ranks: the heads divide by it, the key-value heads divide it or by it."""
    return heads % size == 0 and (kv_heads % size == 0 or size % kv_heads == 0)
