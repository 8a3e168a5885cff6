"""Mixture-of-experts policies (transformers' Qwen3-MoE, Qwen2-MoE, OLMoE, Mixtral): what training needs beyond a
dense model, through one forward hook on each decoder layer's router, the module that picks each token's top-k
experts and returns (router_logits [tokens, experts], gate values [tokens, k], expert indices [tokens, k]).

- Metrics: the routes of every training forward are counted: per layer, the most-loaded expert's share of the
  routed token slots (1 / experts when balanced), the router's entropy, and the load-balancing loss's value.
- The load-balancing loss (--router-aux-loss-coef): off by default in RL, see MoeArgs.
- Routing replay (--routing-replay, "R3", https://arxiv.org/abs/2510.11370): the rollout engine records the experts
  each token went through in every layer; the samples carry them ("routes", [prompt + response - 1, layers, k],
  vLLM's layout: the last sampled token never went through the model) and the trainer's forwards use them instead
  of their own top-k, so the old, current and reference log-probs run the experts that sampled the tokens. The gate
  values stay the router's own probabilities of those experts (renormalised where the model renormalises), so the
  router still learns through them, as it does through its own top-k.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist

from sharding.vllm_moe import is_moe

# The routers this code knows, by model type: each computes softmax(logits), takes the top k, and (per the config's
# norm_topk_prob; Mixtral always) renormalises their probabilities into the gate values.
ROUTERS = {"qwen3_moe": "Qwen3MoeTopKRouter", "qwen2_moe": "Qwen2MoeTopKRouter", "olmoe": "OlmoeTopKRouter",
           "mixtral": "MixtralTopKRouter"}


@dataclass
class MoeArgs:
    """The flag of every script that trains a mixture-of-experts policy (each script's Args extends it)."""
    router_aux_loss_coef: float = 0.0
    """weight of the routers' load-balancing loss (Switch Transformer's, as transformers computes it, per MoE layer
    and averaged over them) added to the policy loss; the pretraining value is the config's router_aux_loss_coef
    (0.001 for Qwen3-30B-A3B). 0 (off) by default: RL's updates are few and small next to pretraining's, the moe/
    metrics show whether the load drifts, and the loss's gradient moves the routers for no reward, away from the
    routes the rollout engine takes. It is a mean per micro-batch, so the update depends a little on the split"""


@dataclass
class RoutingReplayArgs:
    """The routing-replay flag of the scripts whose loss compares the old and current policies (grpo.py, ppo.py)."""
    routing_replay: bool = False
    """the rollout engine records the experts each token went through (vLLM's enable_return_routed_experts; the hf
    engine its own), and the trainer's forwards use them instead of their own top-k, so the sampling, old, current
    and reference policies run the same experts; moe/route_agreement is how often the trainer would have chosen the
    same ones. Single-turn rollouts only"""


def check_routing_replay(args, config) -> None:
    """One line for --routing-replay where it cannot work: a model without experts, or whose router this code does
    not know, or multi-turn episodes."""
    if not args.routing_replay:
        return
    if not is_moe(config) or config.model_type not in ROUTERS:
        raise ValueError(f"--routing-replay: {no_known_router(config)}")
    if args.env is not None or args.tools is not None:
        raise ValueError("--routing-replay: single-turn rollouts only (an episode's turns would need their routes "
                         "joined across turns), not with --env or --tools")


def no_known_router(config) -> str:
    if not is_moe(config):
        return f"the model has no experts (a dense {config.model_type} model)"
    return (f"{config.model_type} models route their experts in a way this code does not know (it knows "
            f"{', '.join(ROUTERS)})")


class RouterHooks:
    """The state the router hooks of one model share: this pass's replayed routes, whether it counts towards the
    step's metrics, and the sums those are made of."""

    def __init__(self, layers: list[torch.nn.Module], aux_coef: float):
        routers = [(i, m) for i, layer in enumerate(layers) for m in layer.modules()
                   if type(m).__name__ in ROUTERS.values()]
        self.num_layers, self.aux_coef = len(layers), aux_coef
        self.moe_layers = [i for i, _ in routers]
        self.top_k, self.num_experts = routers[0][1].top_k, routers[0][1].num_experts
        self.routes = None  # [layers, tokens, k] long, -1: the router's own choice; set per pass, kept for recompute
        self.counted = None  # how many of this pass's tokens count (the rest: padding); None: all
        self.collect = False  # this pass is a training forward: count its routes
        self.aux = []  # this pass's per-layer load-balancing losses (with gradient)
        self.recording = None  # layer -> [tokens, k] of each forward: the HF engine's generate records its routes
        self.sums = None
        for i, router in routers:
            router.register_forward_hook(lambda module, inputs, output, layer=i: self._hook(module, layer, output))

    def start_pass(self, routes: torch.Tensor | None, counted: int | None, collect: bool) -> None:
        self.routes, self.counted, self.collect, self.aux = routes, counted, collect, []

    def _hook(self, router, layer: int, output):
        logits, gates, experts = output  # [tokens, experts], [tokens, k], [tokens, k]
        replayed = self.routes is not None
        if replayed:
            recorded = self.routes[layer]
            if len(recorded) != len(experts):
                raise RuntimeError(f"routing replay: {len(recorded)} recorded routes for {len(experts)} tokens")
            given = recorded[:, :1] >= 0  # [tokens, 1]: a recorded route (else the router's own)
            own = experts
            experts = torch.where(given, recorded, experts)
            chosen = torch.softmax(logits, dim=-1, dtype=torch.float).gather(-1, experts)
            if getattr(router, "norm_topk_prob", True):
                chosen = chosen / chosen.sum(dim=-1, keepdim=True)
            gates = chosen.to(gates.dtype)
        if self.recording is not None:
            self.recording.setdefault(layer, []).append(experts.detach().to(torch.int16))
        n = len(logits) if self.counted is None else self.counted
        with_loss = self.aux_coef and torch.is_grad_enabled()
        if not (with_loss or self.collect):
            return logits, gates, experts
        load = torch.bincount(experts[:n].flatten(), minlength=self.num_experts).to(logits.device)  # [experts]
        aux = None
        if with_loss:
            # The loss's term, computed in the forward and again in its recomputation with activation checkpointing
            # (collect is off by then): both must save the same tensors for backward. Kept from the forward only.
            aux = self._aux_loss(load, torch.softmax(logits[:n].float(), dim=-1))
            if self.collect:
                self.aux.append(aux)
        if self.collect:  # the metrics, without gradient: nothing saved that a recomputation would not save again
            with torch.no_grad():
                agree = None
                if replayed:  # the recorded set of experts equals the trainer's own (order aside)
                    same = (own[:n].sort(-1).values == experts[:n].sort(-1).values).all(-1)
                    agree = torch.stack([(same & given[:n, 0]).sum(), given[:n, 0].sum()]).float()
                self._count(layer, logits[:n], load, agree, aux)
        return logits, gates, experts

    def _aux_loss(self, load, probs) -> torch.Tensor:
        """transformers' load_balancing_loss_func on one layer: experts * sum_e (tokens routed to e / tokens) * mean
        p_e, from the layer's expert counts `load` and router probabilities `probs` [tokens, experts]."""
        tokens = max(len(probs), 1)  # (a filler pass counts none of its tokens: 0, not NaN)
        return self.num_experts * (load / tokens * probs.sum(0) / tokens).sum()

    def _count(self, layer: int, logits, load, agree, aux) -> None:
        """Adds a pass's routes of one layer to the step's sums (aux: its load-balancing loss, if computed)."""
        if self.sums is None:
            self.sums = self._zero_sums(logits.device)
        log_probs = torch.log_softmax(logits.float(), dim=-1)
        probs = log_probs.exp()
        self.sums["load"][layer] += load
        self.sums["entropy"][layer] += -(probs * log_probs).sum()
        self.sums["tokens"][layer] += len(logits)
        self.sums["aux"][layer] += (self._aux_loss(load, probs) if aux is None else aux) * len(logits)
        if agree is not None:
            self.sums["agree"] += agree

    def _zero_sums(self, device) -> dict[str, torch.Tensor]:
        zeros = lambda *shape: torch.zeros(*shape, dtype=torch.float64, device=device)
        return {"load": zeros(self.num_layers, self.num_experts), "entropy": zeros(self.num_layers),
                "tokens": zeros(self.num_layers), "aux": zeros(self.num_layers), "agree": zeros(2)}

    def take_metrics(self, device) -> dict[str, float]:
        """Collective: the sums since the last call, over every rank, as logged; then starts over."""
        sums = self.sums or self._zero_sums(device)
        self.sums = None
        flat = torch.cat([v.flatten() for v in sums.values()]).to(device)
        if dist.is_initialized():
            dist.all_reduce(flat)
        flat = flat.cpu()
        layers, experts = self.num_layers, self.num_experts
        load = flat[:layers * experts].view(layers, experts)[self.moe_layers]
        entropy, tokens, aux = flat[layers * experts:].split(layers)[:3]
        entropy, tokens, aux = entropy[self.moe_layers], tokens[self.moe_layers], aux[self.moe_layers]
        agree = flat[-2:]
        if tokens.sum() == 0:
            return {}
        share = load.max(-1).values / load.sum(-1).clamp(min=1)  # the most-loaded expert's share, per MoE layer
        metrics = {"moe/max_load": share.max().item(), "moe/router_entropy": (entropy.sum() / tokens.sum()).item(),
                   "moe/aux_loss": (aux.sum() / tokens.sum()).item(),
                   **{f"moe/max_load/layer{i}": s.item() for i, s in zip(self.moe_layers, share)}}
        if agree[1] > 0:
            metrics["moe/route_agreement"] = (agree[0] / agree[1]).item()
        return metrics


def install_router_hooks(model, layers: list[torch.nn.Module], aux_coef: float = 0.0) -> RouterHooks | None:
    """Hooks on a model's routers (None for a dense model or an unknown router); the model keeps them as
    model.router_hooks. layers: its decoder layers, in order (their index is the routes' layer index)."""
    config = model.config.get_text_config()
    if config.model_type not in ROUTERS:
        if aux_coef:
            raise ValueError(f"--router-aux-loss-coef: {no_known_router(config)}")
        return None
    model.router_hooks = RouterHooks(layers, aux_coef)
    return model.router_hooks


def router_hooks(model) -> RouterHooks | None:
    return getattr(model, "router_hooks", None)


def pack_routes(samples: list[dict]) -> torch.Tensor | None:
    """The recorded routes of samples packed end to end like their tokens (common/train/batching.py): [layers,
    total, k] long, -1 on each sequence's last token (it never went through the rollout engine: the trainer's own
    choice there changes none of the scored log-probs). None when the samples carry none."""
    if not samples or samples[0].get("routes") is None:
        return None
    rows = []
    for s in samples:
        routes, length = torch.as_tensor(s["routes"]), len(s["prompt_ids"]) + len(s["response_ids"])
        if len(routes) not in (length - 1, length):
            raise ValueError(f"routing replay: a sample of {length} tokens came with {len(routes)} routes (expected "
                             f"{length - 1}): its tokens and routes are not aligned")
        rows += [routes[:length - 1].long(), torch.full((1, *routes.shape[1:]), -1, dtype=torch.long)]
    return torch.cat(rows).transpose(0, 1).contiguous()


def router_aux_loss(model, share: float) -> torch.Tensor | float:
    """The last training forward's load-balancing loss, averaged over MoE layers, times --router-aux-loss-coef and
    `share` (this micro-batch's part of the mini-batch's tokens, so micro-batches add up to the mini-batch's loss);
    0 where off."""
    hooks = router_hooks(model)
    if hooks is None or not hooks.aux:
        return 0.0
    return hooks.aux_coef * share * torch.stack(hooks.aux).mean()


def router_metrics(model, device) -> dict[str, float]:
    """Collective: the MoE metrics of the training forwards since the last call ({} for a dense model)."""
    hooks = router_hooks(model)
    return {} if hooks is None else hooks.take_metrics(device)


class recorded_routes:
    """Records the routes of every forward inside it (the HF engine's generate); `steps` then holds one [tokens,
    layers, k] int16 per forward (zeros for dense layers, as vLLM returns them). Replay is off inside."""

    def __init__(self, model, on: bool = True):
        self.hooks, self.on, self.steps = router_hooks(model), on, []

    def __enter__(self):
        if self.hooks is not None:
            self.hooks.start_pass(None, None, collect=False)  # no routes of a training pass
            self.hooks.recording = {} if self.on else None
        return self

    def __exit__(self, *exc):
        if self.hooks is None or not self.on:
            return
        recording, self.hooks.recording = self.hooks.recording, None
        forwards = len(next(iter(recording.values()), []))
        for f in range(forwards):
            first = recording[self.hooks.moe_layers[0]][f]
            step = torch.zeros(len(first), self.hooks.num_layers, self.hooks.top_k, dtype=torch.int16)
            for layer, per_forward in recording.items():
                step[:, layer] = per_forward[f].cpu()
            self.steps.append(step)

    def sequence(self, row: int, rows: int, prompt_len: int, padded_len: int, response_len: int) -> torch.Tensor:
        """The routes of generated row `row` (of `rows`, each left-padded to padded_len in the first forward, then one
        token per forward): its prompt's and all but its last response token's, [prompt_len + response_len - 1,
        layers, k], vLLM's layout."""
        prompt = self.steps[0].view(rows, padded_len, *self.steps[0].shape[1:])[row, padded_len - prompt_len:]
        return torch.cat([prompt, *[step[row:row + 1] for step in self.steps[1:response_len]]])
