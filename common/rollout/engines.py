"""Rollout engines: turn prompt token ids into sampled responses with their log-probs.

Every engine has the same six methods, so the training loop never knows which one it drives:
`generate` (token ids in, token ids and, if asked, sampled-token log-probs out; each prompt's group also goes to an
optional `on_finish(index, completions)` as soon as it is complete, to be scored while the rest generate),
`generate_until` (partial rollouts: generates `Request`s until a phase's `stop()` holds and returns the responses it
cut, to be continued in a later phase; common/rollout/partial.py),
`run_turns` (multi-turn episodes: one turn per request, new requests arriving while others generate; see
common/rollout/episodes.py),
`update_weights` (bring the trainer's latest weights in), `sleep` (free memory while training) and `check_weights`
(verify the last sync).
`HFRolloutEngine` samples with the trainer's own FSDP2 model through HF `generate`: slow, but it runs anywhere
(CPU, laptop, tests). `VLLMRolloutEngine` (common/rollout/vllm_engine.py) is the real GPU path; it imports vllm only when
one is built, so this module imports anywhere. Both return `Completion`s (common/rollout/completion.py).
"""

import contextlib
import importlib.util
import itertools
import math
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import LogitsProcessor, StoppingCriteria

from common.rollout.completion import Completion, Request
from common.rollout.vllm_engine import VLLMRolloutEngine
from common.run.distributed import max_over_ranks
from common.run.errors import user_error
from common.run.signals import crash_point
from common.train.moe import recorded_routes


@user_error
class NonFiniteLogits(RuntimeError):
    """The policy's next-token probabilities are inf or NaN: its weights are broken (by a learning rate far too
    high, usually), and sampling cannot go on."""


class HFRolloutEngine:
    """Samples from the training model itself, so there are no weights to sync and nothing to sleep."""

    def __init__(self, model, stop_token_ids: list[int], pad_token_id: int, rank: int = 0, record_routes: bool = False):
        self.model, self.stop_token_ids, self.pad_token_id, self.rank = model, stop_token_ids, pad_token_id, rank
        self.record_routes = record_routes  # MoE --routing-replay: each sampled response's experts, as vLLM does

    @torch.no_grad()
    def generate(self, prompt_ids: list[list[int]], n: int, max_tokens: int, temperature: float, top_p: float,
                 seed: int, greedy: bool = False, on_finish=None, logprobs: bool = True) -> list[list[Completion]]:
        device, longest = next(self.model.parameters()).device, max(len(p) for p in prompt_ids)
        sampling = dict(do_sample=False) if greedy else dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=0)
        # A private RNG stream per (seed, rank): sampling never disturbs the training RNG, and ranks differ.
        routes = recorded_routes(self.model, on=self.record_routes and not greedy)
        with self._generating(prompt_ids) as inputs, routes, \
                torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(seed * 1000 + self.rank)
            out = self.model.generate(
                **inputs, max_new_tokens=max_tokens, num_return_sequences=1 if greedy else n,
                eos_token_id=self.stop_token_ids, pad_token_id=self.pad_token_id, output_scores=True,
                return_dict_in_generate=True, synced_gpus=dist.is_initialized() and dist.get_world_size() > 1,
                **sampling)
        new_tokens = out.sequences[:, longest:].cpu()  # [batch * n, steps]
        token_logprobs = None
        if logprobs:  # `scores` are the processed logits (temperature, top-p applied) the token was sampled from
            scores = torch.stack(out.scores, dim=1).float()  # [batch * n, steps, vocab]
            token_logprobs = F.log_softmax(scores, dim=-1).gather(
                -1, new_tokens.to(scores.device).unsqueeze(-1)).squeeze(-1).cpu()
        completions, per_prompt = [], 1 if greedy else n
        for row in range(new_tokens.shape[0]):
            ids = new_tokens[row].tolist()
            stop = next((i for i, t in enumerate(ids) if t in self.stop_token_ids), None)
            length = len(ids) if stop is None else stop + 1  # keep the stop token: the policy must learn to stop
            experts = routes.sequence(row, new_tokens.shape[0], len(prompt_ids[row // per_prompt]), longest,
                                      length) if routes.steps else None
            completions.append(Completion(ids[:length], None if token_logprobs is None else
                                          token_logprobs[row, :length].tolist(), stop is not None, experts))
        groups = [completions[i * per_prompt:(i + 1) * per_prompt] for i in range(len(prompt_ids))]
        for i, group in enumerate(groups if on_finish else []):  # one batched generate: all finish together
            on_finish(i, group)
        return groups

    def run_turns(self, runner, temperature: float, top_p: float, seed: int, greedy: bool = False,
                  logprobs: bool = True, stop_token_ids: list[int] = (), ignore_eos: bool = False) -> None:
        """Multi-turn episodes in lock-step rounds: every turn ready (waiting for the environments' answers to the
        last round) is generated in one batch. Collective: FSDP's generate runs on every rank the same number of
        times, so a rank whose episodes ended runs a one-token dummy until all are done. Round r is seeded with
        seed + r: round 0 samples exactly what `generate` would for the same prompts. ignore_eos: every turn runs
        to its length (benchmarks)."""
        stops = self.stop_token_ids
        self.stop_token_ids = [] if ignore_eos else list(dict.fromkeys([*stops, *stop_token_ids]))
        try:
            for round_ in itertools.count():
                turns = runner.next_turns(block=True, every=True)
                if not decided_by_any_rank(bool(turns), next(self.model.parameters()).device):
                    return
                prompts = [t.prompt_ids for t in turns] or [[self.pad_token_id]]
                groups = self.generate(prompts, n=1, max_tokens=max([t.max_tokens for t in turns] or [1]),
                                       temperature=temperature, top_p=top_p, seed=seed + round_, greedy=greedy,
                                       logprobs=logprobs)
                for turn, (completion,) in zip(turns, groups):
                    runner.finish(turn.key, cut_to(completion, turn.max_tokens))
        finally:
            self.stop_token_ids = stops

    @torch.no_grad()
    def generate_until(self, requests: list[Request], temperature: float, top_p: float, on_finish, stop,
                       logprobs: bool = True) -> tuple[dict, list[tuple[float, int]]]:
        """Generates every request in one batch until it ends (a stop token or its max_tokens: on_finish(key,
        completion) at once) or until stop(), asked after every decode step, holds. Returns ({key: the Completion
        of the tokens generated so far} for the requests stop() cut, [(seconds, requests still running)] after each
        decode step). Sampling is SeededSampling's: each token's draw depends on its request's seed and position
        only, so a cut response continued later under the same weights is the response generated in one go."""
        dummy = not requests or stop()
        if dummy:  # nothing to generate here, but FSDP's forward passes are collective: one token of a dummy
            requests, on_finish = [Request(None, [self.pad_token_id], 1, 0)], lambda key, completion: None
        longest = max(len(r.prompt_ids) for r in requests)
        sampler = SeededSampling(requests, temperature, top_p, longest)
        phase = PhaseEnd(requests, self.stop_token_ids, longest, sampler, on_finish, stop, logprobs)
        with self._generating([r.prompt_ids for r in requests]) as inputs:
            self.model.generate(
                **inputs, do_sample=False, max_new_tokens=max(r.max_tokens for r in requests),
                eos_token_id=self.stop_token_ids, pad_token_id=self.pad_token_id, logits_processor=[sampler],
                stopping_criteria=[phase], synced_gpus=dist.is_initialized() and dist.get_world_size() > 1)
        return ({}, []) if dummy else (phase.cut(), phase.running)

    @contextlib.contextmanager
    def _generating(self, prompt_ids: list[list[int]]):
        """HF generate's inputs for these prompts, left-padded so that every prompt ends where generation starts,
        with the model in eval mode on sdpa attention (padded batches and a KV cache; training may use packed rows)
        meanwhile. FSDP2 all-gathers weights in every forward, so ranks must run the same number of decode steps:
        generate is called with synced_gpus, and a rank whose sequences finished keeps stepping until all are done.
        Afterwards the root's weights, which FSDP2 keeps gathered after forwards with no backward, are resharded."""
        device, longest = next(self.model.parameters()).device, max(len(p) for p in prompt_ids)
        input_ids = torch.full((len(prompt_ids), longest), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros_like(input_ids)
        for i, p in enumerate(prompt_ids):
            input_ids[i, longest - len(p):] = torch.tensor(p)
            attention_mask[i, longest - len(p):] = 1
        was_training, attention = self.model.training, self.model.config._attn_implementation
        self.model.eval()
        self.model.set_attn_implementation("sdpa")
        with non_finite_logits_named():
            yield {"input_ids": input_ids.to(device), "attention_mask": attention_mask.to(device)}
        self.model.train(was_training)
        self.model.set_attn_implementation(attention)
        if hasattr(self.model, "reshard"):
            self.model.reshard()

    def update_weights(self, model) -> dict[str, float]:
        return {}  # generates with the trained model itself

    def sleep(self) -> None:
        pass

    def check_weights(self, model) -> None:
        pass

    def close(self) -> None:
        pass


def decided_by_any_rank(flag: bool, device) -> bool:
    """Collective (where torch.distributed runs): whether `flag` holds on any rank."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return flag
    return bool(max_over_ranks(float(flag), device))


def cut_to(completion: Completion, max_tokens: int) -> Completion:
    """A completion generated in a batch with a larger max_tokens, as if it had been generated with max_tokens."""
    if len(completion.response_ids) <= max_tokens:
        return completion
    return Completion(completion.response_ids[:max_tokens],
                      None if completion.logprobs is None else completion.logprobs[:max_tokens], False)


@contextlib.contextmanager
def non_finite_logits_named():
    """torch.multinomial's complaint about the probabilities it was given, as what it means for the run."""
    try:
        yield
    except RuntimeError as e:
        if "probability tensor contains" not in str(e):
            raise
        raise NonFiniteLogits("sampling failed: the policy's next-token probabilities are inf or NaN, so its "
                              "weights are broken") from None


def resolve_engine_kind(kind: str) -> str:
    """"auto" -> "vllm" when CUDA and vllm are there, else "hf"."""
    if kind != "auto":
        return kind
    return "vllm" if torch.cuda.is_available() and importlib.util.find_spec("vllm") is not None else "hf"


def make_rollout_engine(kind: str, model, model_path: str, tokenizer, stop_token_ids: list[int], rank: int,
                        tp_size: int, gpu_memory: float | None, max_model_len: int, seed: int, enforce_eager: bool,
                        sync_bucket_mb: int, sleep_level: int | None = None, dtype: torch.dtype = torch.bfloat16,
                        max_sequences: int = 256, lora: dict | None = None, record_routes: bool = False):
    """kind: "vllm", "hf" or "auto" (see resolve_engine_kind). vLLM's memory and sleep, and `lora` (adapters through
    vLLM's LoRA layers): see VLLMRolloutEngine. The HF engine generates with the policy itself, adapters and all.
    record_routes (MoE --routing-replay): each completion carries the experts its tokens went through."""
    kind = resolve_engine_kind(kind)
    crash_point("start-up", 0)  # tests: an engine that does not fit beside the trainer (oom)
    if kind == "hf":
        return HFRolloutEngine(model, stop_token_ids, tokenizer.pad_token_id, rank, record_routes)
    if kind == "vllm":
        return VLLMRolloutEngine(model_path, tp_size=tp_size, gpu_memory_utilization=gpu_memory,
                                 max_model_len=max_model_len, stop_token_ids=stop_token_ids, seed=seed,
                                 enforce_eager=enforce_eager, sync_bucket_mb=sync_bucket_mb,
                                 sleep_level=sleep_level, dtype=dtype, max_sequences=max_sequences, lora=lora,
                                 record_routes=record_routes)
    raise ValueError(f"--rollout-engine must be auto, hf or vllm, got {kind!r}")


class SeededSampling(LogitsProcessor):
    """Samples each token from softmax(logits / temperature), top-p filtered, by the Gumbel-max trick with noise
    drawn from a generator seeded by (request seed, position in the response): argmax(log p + Gumbel noise) is a
    draw from p. A token's draw thus depends on its request and place alone, not on the batch it is generated in.
    Returns scores whose argmax is the sampled token (for generate's greedy step); `logprobs[i]` collects request
    i's sampled-token log-probs under the filtered distribution."""

    def __init__(self, requests: list[Request], temperature: float, top_p: float, prompt_len: int):
        self.requests, self.temperature, self.top_p, self.prompt_len = requests, temperature, top_p, prompt_len
        self.logprobs: list[list[float]] = [[] for _ in requests]

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        step = input_ids.shape[1] - self.prompt_len  # tokens generated in this call so far
        logp = F.log_softmax(top_p_filtered(scores.float() / self.temperature, self.top_p), dim=-1)  # [batch, vocab]
        noise = torch.stack([gumbel_noise(r.seed, r.position + step, scores.shape[-1]) for r in self.requests])
        chosen = (logp + noise.to(logp.device)).argmax(dim=-1)  # [batch]
        for i, lp in enumerate(logp.gather(-1, chosen[:, None]).squeeze(-1).tolist()):
            self.logprobs[i].append(lp)
        return torch.full_like(scores, -math.inf).scatter_(-1, chosen[:, None], 0.0)


def top_p_filtered(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """logits [batch, vocab] with -inf outside the smallest set of tokens whose probability reaches top_p."""
    if top_p >= 1:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    outside = probs.cumsum(dim=-1) - probs >= top_p  # the tokens before this one already reach top_p
    return logits.scatter(-1, order, sorted_logits.masked_fill(outside, -math.inf))


def gumbel_noise(seed: int, position: int, vocab: int) -> torch.Tensor:
    """[vocab] Gumbel(0, 1) noise, a function of (seed, position) alone."""
    generator = torch.Generator().manual_seed((seed * 1_000_003 + position) % 2**63)
    uniform = torch.rand(vocab, generator=generator).clamp(min=1e-20)
    return -torch.log(-torch.log(uniform))


class PhaseEnd(StoppingCriteria):
    """generate_until's stopping rule, after every decode step: a request ends at a stop token or its max_tokens
    (on_finish is called with it at once); every request ends once stop() holds. What the phase cut is `cut()`."""

    def __init__(self, requests, stop_token_ids, prompt_len, sampler: SeededSampling, on_finish, stop,
                 logprobs: bool):
        self.requests, self.stop_token_ids, self.prompt_len, self.sampler = requests, set(stop_token_ids), prompt_len, sampler
        self.on_finish, self.stop, self.logprobs = on_finish, stop, logprobs
        self.ended = [False] * len(requests)
        self.input_ids: torch.Tensor | None = None
        self.start, self.running = time.perf_counter(), []

    def completion(self, i: int, finished: bool) -> Completion:
        """Request i's tokens so far (a row that ended is padded after its end, which is cut)."""
        ids = self.input_ids[i, self.prompt_len:].tolist()
        length = next((j + 1 for j, t in enumerate(ids) if t in self.stop_token_ids), len(ids))
        ids = ids[:min(length, self.requests[i].max_tokens)]
        return Completion(ids, self.sampler.logprobs[i][:len(ids)] if self.logprobs else None, finished)

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        self.input_ids, length = input_ids, input_ids.shape[1] - self.prompt_len
        last = input_ids[:, -1].tolist()  # a running row holds no earlier stop token: it would have ended there
        for i, request in enumerate(self.requests):
            if self.ended[i]:
                continue
            stopped = last[i] in self.stop_token_ids
            if stopped or length >= request.max_tokens:
                self.ended[i] = True
                self.on_finish(request.key, self.completion(i, finished=stopped))
        self.running.append((time.perf_counter() - self.start, self.ended.count(False)))
        if self.stop():
            return torch.ones(len(self.requests), dtype=torch.bool, device=input_ids.device)
        return torch.tensor(self.ended, device=input_ids.device)

    def cut(self) -> dict:
        return {r.key: self.completion(i, finished=False) for i, r in enumerate(self.requests) if not self.ended[i]}
