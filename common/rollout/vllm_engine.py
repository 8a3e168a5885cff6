"""Rollouts from a vLLM engine that lives inside the torchrun processes that train (colocated).

Every rank builds the same engine with vLLM's "external_launcher" backend: rank r serves tensor-parallel shard
r % tp of replica r // tp, using the trainer's own torch.distributed world. The ranks of one replica must feed
it the same requests in the same order, so `generate` first gathers their prompts, and seeds every request
explicitly. The engine starts with dummy weights; `update_weights` streams the trainer's weights in before every
rollout (sharding/vllm_sync.py), and `sleep` hands vLLM's memory to the trainer between rollouts.

What sleeping frees (sleep_level), and what the next sync then pays for (benchmarks/README.md, bench_sync.py):
  0: the KV cache only. The weights stay on the GPU, where the sync overwrites them in place: the cheapest sleep and
     sync; the trainer has the memory of vLLM's weights (its shard of the model, in the rollout dtype) less.
  1: also the weights, parked in CPU memory; the wake-up copies them back, only for the sync to overwrite them.
  2: also the weights, dropped; the wake-up maps empty memory that the sync fills.
  None: 0 when vLLM's weights take at most 15% of the GPU's memory, else 2.
Mapping memory back costs about 1-5 ms per GB, so the KV cache is sized by default to what a rollout needs
(`kv_cache_gib`), not to a share of the GPU.
A LoRA policy reaches vLLM merged into full weights, like any other, or with `lora` (--lora-sync adapter) through
vLLM's own LoRA layers: the base streamed in once, then each update's adapters as a PEFT directory (each rank its
own, under the run's directory), loaded under a new name and id (sharding/vllm_lora.py). The base must then survive sleep: level
0 or 1, never 2.
vllm itself is imported inside the methods that use it: it is optional (GPU only), and common/rollout/engines.py imports
this module on every machine.
"""

import hashlib
import itertools
import os
import shutil
import time

import torch
import torch.distributed as dist
from transformers import AutoConfig

from common.rollout.completion import Completion, Request
from common.rollout.vllm_memory import kv_cache_gib
from common.run.gpus import default_sleep_level
from sharding.vllm_lora import vllm_max_rank, write_adapter
from sharding.vllm_moe import check_vllm_moe_layout
from sharding.vllm_sync import adapter_tensors, check_weight_sync, sync_weights_to_vllm


def request_seed(step_seed: int, replica: int, request_index: int | str) -> int:
    """A sampling seed per request: equal on the ranks of one replica, different across replicas and steps.

    vLLM seeds the n samples of a request with seed, seed + 1, ..., seed + n - 1; hashing spreads the requests'
    seeds over 2**62 values, so those runs do not overlap in practice.
    """
    key = f"{step_seed}/{replica}/{request_index}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 2  # < 2**62: fits int64


class VLLMRolloutEngine:
    def __init__(self, model_path: str, tp_size: int, gpu_memory_utilization: float | None, max_model_len: int,
                 stop_token_ids: list[int], seed: int, enforce_eager: bool = False,
                 dtype: torch.dtype = torch.bfloat16, sync_bucket_mb: int = 512, sleep_level: int | None = None,
                 max_sequences: int = 256, lora: dict | None = None, record_routes: bool = False):
        """Call on every rank, after torch.distributed is initialised; model_path needs only config.json.

        gpu_memory_utilization: vLLM's share of the GPU (weights and KV cache); above 1, GiB of KV cache; None, the KV
        cache of max_sequences sequences at once (kv_cache_gib). sleep_level: see the module's docstring. After
        level 2 the engine cannot generate until `update_weights` has loaded the trainer's weights. lora: {"rank",
        "targets", "dir"} of a LoRA policy whose adapters go to vLLM's LoRA layers, written under "dir" (see the
        module's docstring). record_routes: vLLM returns the experts each token went through (MoE routing replay),
        which every sampled completion carries (Completion.routes).
        """
        if sleep_level not in (None, 0, 1, 2):
            raise ValueError(f"the rollout engine's sleep level is 0, 1 or 2, got {sleep_level}")
        if lora and sleep_level == 2:
            raise ValueError("--rollout-sleep-level 2 drops vLLM's base weights, which --lora-sync adapter loads once: "
                             "use 0 or 1")
        from vllm import LLM

        rank, world = dist.get_rank(), dist.get_world_size()
        if world % tp_size:
            raise ValueError(f"tensor-parallel size {tp_size} must divide the world size {world}")
        self.replica, self.tp_rank, self.tp_size = rank // tp_size, rank % tp_size, tp_size
        self.stop_token_ids, self.dtype = list(stop_token_ids), dtype
        self.sync_bucket_mb = sync_bucket_mb
        self.asleep, self.slept_at = False, None
        self.request_ids = itertools.count()  # generate_until's request ids: unique over the run
        # One small CPU group per replica to share prompts; every rank creates all of them, in the same order.
        self.tp_group = None
        if tp_size > 1:
            for replica in range(world // tp_size):
                group = dist.new_group(list(range(replica * tp_size, (replica + 1) * tp_size)), backend="gloo")
                if replica == self.replica:
                    self.tp_group = group
        # The engine core must run in this process: vLLM asserts it for external_launcher, and reads it once.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        torch.cuda.empty_cache()  # vLLM sizes itself from the free memory: the trainer's cached blocks are not free
        device_bytes = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        if gpu_memory_utilization is None:
            self.kv_cache_gib = kv_cache_gib(AutoConfig.from_pretrained(model_path), dtype, tp_size, max_sequences,
                                             max_model_len, device_bytes / 2**30)
        else:
            self.kv_cache_gib = gpu_memory_utilization if gpu_memory_utilization > 1 else None
        # GiB of KV cache are set outright: vLLM then skips its start-up memory profiling, which fails when other
        # processes on the GPU change their memory use meanwhile (several runs sharing one GPU: scripts/ablate.py).
        memory = dict(gpu_memory_utilization=gpu_memory_utilization) if self.kv_cache_gib is None else \
            dict(gpu_memory_utilization=0.01, kv_cache_memory_bytes=int(self.kv_cache_gib * 2**30))
        # One adapter slot: a version's requests all finish before the next version is loaded.
        adapters = {} if not lora else dict(enable_lora=True, max_lora_rank=vllm_max_rank(lora["rank"]), max_loras=1,
                                            max_cpu_loras=2, lora_target_modules=list(lora["targets"]))
        self.lora_request, self.base_loaded, self.adapter_dir = None, False, lora["dir"] if lora else None
        if self.adapter_dir is not None:
            shutil.rmtree(self.adapter_dir, ignore_errors=True)  # a killed run's
        self.llm = LLM(
            model=model_path, distributed_executor_backend="external_launcher", tensor_parallel_size=tp_size,
            enable_sleep_mode=True, logprobs_mode="processed_logprobs", skip_tokenizer_init=True,
            load_format="dummy",  # the real weights arrive with the first update_weights
            **memory, max_model_len=max_model_len,
            dtype=str(dtype).removeprefix("torch."), seed=seed, enforce_eager=enforce_eager, **adapters,
            **(dict(enable_return_routed_experts=True) if record_routes else {}))
        # vLLM's worker and model object in this process (V1 engine, in-process executor); get_model() unwraps CUDA
        # graphs.
        self.worker = self.llm.llm_engine.model_executor.driver_worker.worker
        self.vllm_model = self.worker.get_model()
        check_vllm_moe_layout(self.vllm_model)  # experts where the sync writes them, or one line now
        weight_bytes = self._allocated_bytes("weights")  # what level 0 keeps mapped
        self.sleep_level = default_sleep_level(weight_bytes, device_bytes, keep_weights=bool(lora)) \
            if sleep_level is None else sleep_level

    def _gather_prompts(self, prompt_ids: list[list[int]]) -> list[list[list[int]]]:
        """Prompts of every rank of this replica, by TP rank: [tp_size][num_prompts_of_that_rank][tokens]."""
        prompt_ids = [[int(t) for t in p] for p in prompt_ids]
        if self.tp_group is None:
            return [prompt_ids]
        gathered = [None] * self.tp_size
        dist.all_gather_object(gathered, prompt_ids, group=self.tp_group)
        return gathered

    def generate(self, prompt_ids: list[list[int]], n: int, max_tokens: int, temperature: float, top_p: float,
                 seed: int, greedy: bool = False, ignore_eos: bool = False, on_finish=None,
                 logprobs: bool = True) -> list[list[Completion]]:
        """result[i] holds the completions of prompt_ids[i]: n of them, or one when greedy. on_finish(i, result[i])
        is called as soon as all of prompt i's completions are done, while the engine goes on with the others.

        logprobs=False: no sampled-token log-probs (Completion.logprobs is None). vLLM's per-token bookkeeping of
        them costs about a quarter of the rollout time of a small model (SmolLM2-135M on GSM8K, benchmarks/README.md).

        ignore_eos generates exactly max_tokens (benchmarks): stop tokens are ignored too.
        """
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        self._wake_for_generation()
        by_rank = self._gather_prompts(prompt_ids)
        requests = [TokensPrompt(prompt_token_ids=p) for rank_prompts in by_rank for p in rank_prompts]
        params = [SamplingParams(
            n=1 if greedy else n,  # vLLM allows only n=1 with greedy decoding
            max_tokens=max_tokens, temperature=0.0 if greedy else temperature, top_p=1.0 if greedy else top_p,
            seed=request_seed(seed, self.replica, i), stop_token_ids=[] if ignore_eos else self.stop_token_ids,
            ignore_eos=ignore_eos, logprobs=0 if logprobs else None,  # 0 extra top tokens: the sampled token's only
            flat_logprobs=True, detokenize=False) for i in range(len(requests))]
        first = sum(len(p) for p in by_rank[:self.tp_rank])  # this rank's slice of the replica's requests
        results = [None] * len(prompt_ids)
        if not requests:
            return results
        # LLM.generate's loop, by hand, to see each request finish. enqueue returns vLLM's internal ids, the id it
        # was given plus "-" and a random suffix; outputs carry the given id.
        ids = self.llm.enqueue(requests, params, lora_request=self.lora_request, use_tqdm=False)
        index = {request_id.split("-", 1)[0]: i for i, request_id in enumerate(ids)}
        start, self.busy = time.perf_counter(), []  # [(seconds, requests running)] after each step: the tail's cost
        while self.llm.llm_engine.has_unfinished_requests():
            for output in self.llm.llm_engine.step():  # final outputs only: all n samples of a request at once
                i = index[output.request_id] - first
                if output.finished and 0 <= i < len(prompt_ids):
                    results[i] = [to_completion(c) for c in output.outputs]
                    if on_finish:
                        on_finish(i, results[i])
            self.busy.append((time.perf_counter() - start, self.llm.llm_engine.get_num_unfinished_requests()))
        if None in results:
            raise RuntimeError(f"vLLM finished without {results.count(None)} of this rank's {len(results)} requests")
        return results

    def generate_until(self, requests: list[Request], temperature: float, top_p: float, on_finish, stop,
                       logprobs: bool = True) -> tuple[dict, list[tuple[float, int]]]:
        """Partial rollouts' phase (see engines.py): every request is enqueued at once; vLLM returns each one when
        it ends, and once stop() holds, asked after every engine step, the requests still running are read from its
        output processor (the tokens and log-probs it holds for them) and aborted. Streaming every request's tokens
        at every step instead costs a large share of a small model's decode step. One replica per rank."""
        from types import SimpleNamespace

        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        self._wake_for_generation()
        engine, running, start, busy = self.llm.llm_engine, {}, time.perf_counter(), []
        for request in requests:  # outputs carry the id given here; vLLM's own (internal) one names its state
            given = f"partial-{next(self.request_ids)}"
            running[given] = (request.key, engine.add_request(
                given, TokensPrompt(prompt_token_ids=request.prompt_ids),
                SamplingParams(n=1, max_tokens=request.max_tokens, temperature=temperature, top_p=top_p,
                               seed=request_seed(request.seed, self.replica, request.position),
                               stop_token_ids=self.stop_token_ids, logprobs=0 if logprobs else None,
                               flat_logprobs=True, detokenize=False, output_kind=RequestOutputKind.FINAL_ONLY),
                lora_request=self.lora_request))
        while running and not stop():
            for output in engine.step():
                key, _ = running.pop(output.request_id)
                on_finish(key, to_completion(output.outputs[0]))
            busy.append((time.perf_counter() - start, len(running)))
        cut = {}
        for key, request_id in running.values():  # the phase is over: the rest continue in the next one
            state = engine.output_processor.request_states[request_id]
            cut[key] = to_completion(SimpleNamespace(
                token_ids=list(state.detokenizer.output_token_ids), finish_reason=None,
                logprobs=state.logprobs_processor.logprobs if logprobs else None))
        if running:
            engine.abort_request([request_id for _, request_id in running.values()], internal=True)
        return cut, busy

    def run_turns(self, runner, temperature: float, top_p: float, seed: int, greedy: bool = False,
                  logprobs: bool = True, stop_token_ids: list[int] = (), ignore_eos: bool = False) -> None:
        """Multi-turn episodes as a stream (common/rollout/episodes.py): each turn the runner hands out is enqueued at once
        and the engine steps on, so turns of episodes at different depths share its batches and prefix cache. The
        ranks of a tensor-parallel replica exchange their new turns before every engine step (all of them feed the
        engine the same requests) and stop together once all their episodes have ended. ignore_eos: every turn runs
        to its length (benchmarks)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        self._wake_for_generation()
        engine, keys = self.llm.llm_engine, {}  # request id -> (TP rank that asked, episode key)
        stops = [] if ignore_eos else list(dict.fromkeys([*self.stop_token_ids, *stop_token_ids]))
        while True:
            idle = not engine.has_unfinished_requests()
            turns = runner.next_turns(block=idle)
            by_rank = [(turns, runner.done())]
            if self.tp_group is not None:
                by_rank = [None] * self.tp_size
                dist.all_gather_object(by_rank, (turns, runner.done()), group=self.tp_group)
            if idle and all(done for _, done in by_rank) and not any(t for t, _ in by_rank):
                return
            requests, params, asked = [], [], []
            for rank, (rank_turns, _) in enumerate(by_rank):
                for turn in rank_turns:
                    requests.append(TokensPrompt(prompt_token_ids=turn.prompt_ids))
                    params.append(SamplingParams(
                        n=1, max_tokens=turn.max_tokens, temperature=0.0 if greedy else temperature,
                        top_p=1.0 if greedy else top_p, seed=request_seed(seed, self.replica, f"{turn.key}/{turn.turn}"),
                        stop_token_ids=stops, ignore_eos=ignore_eos, logprobs=0 if logprobs else None,
                        flat_logprobs=True, detokenize=False))
                    asked.append((rank, turn.key))
            if requests:
                ids = self.llm.enqueue(requests, params, lora_request=self.lora_request, use_tqdm=False)
                keys.update({request_id.split("-", 1)[0]: who for request_id, who in zip(ids, asked)})
            if engine.has_unfinished_requests():
                for output in engine.step():
                    rank, key = keys[output.request_id]
                    if output.finished and rank == self.tp_rank:
                        runner.finish(key, to_completion(output.outputs[0]))

    def update_weights(self, model: torch.nn.Module) -> dict[str, float]:
        """Collective: brings the trainer's current weights into vLLM, waking it up around them."""
        start = time.perf_counter()
        if self.asleep and self.slept_at:
            self._make_room("weights")
            # Weights first, the KV cache is not needed to load them. After level 2 this maps empty memory (and
            # restores vLLM's buffers, e.g. rotary tables, from the CPU); after level 1 it copies the old weights back.
            self.llm.wake_up(tags=["weights"])
        synced = time.perf_counter()
        num_bytes = 0
        if self.adapter_dir is None or not self.base_loaded:  # with LoRA layers: the base, once
            num_bytes += sync_weights_to_vllm(model, self.vllm_model, self.sync_bucket_mb, self.dtype)
            self.base_loaded = True
        if self.adapter_dir is not None:
            num_bytes += self._load_adapters(model)
        sync_seconds = time.perf_counter() - synced
        if self.asleep:
            self._wake_kv_cache()
        else:  # awake, the prefix cache holds prompt KV computed by the old weights (sleeping emptied it)
            self.llm.reset_prefix_cache()
        return {"sync/seconds": sync_seconds, "sync/gb": num_bytes / 1e9,
                "sync/gb_per_s": num_bytes / 1e9 / max(sync_seconds, 1e-9),
                "sync/wake_seconds": time.perf_counter() - start - sync_seconds}

    def _load_adapters(self, model: torch.nn.Module) -> int:
        """Collective: the policy's adapters as this version of vLLM's LoRA adapter (a new name and id, which the
        requests carry from now on), written by each rank into its own directory (each rank reads the whole
        adapter and keeps its tensor-parallel slice); the previous version is removed. Returns the bytes written."""
        version = 1 if self.lora_request is None else self.lora_request.lora_int_id + 1
        path = os.path.join(self.adapter_dir, f"v{version}")
        num_bytes = write_adapter(adapter_tensors(model, self.dtype), model.peft_config["default"], path, self.dtype)
        from vllm.lora.request import LoRARequest
        request = LoRARequest(f"policy-v{version}", version, path)
        self.llm.llm_engine.add_lora(request)  # into the GPU slot now: the weights are awake
        if self.lora_request is not None:
            self.llm.llm_engine.remove_lora(self.lora_request.lora_int_id)
            shutil.rmtree(self.lora_request.lora_path, ignore_errors=True)
        self.lora_request = request
        return num_bytes

    def close(self) -> None:
        if self.adapter_dir is not None:
            shutil.rmtree(self.adapter_dir, ignore_errors=True)

    def sleep(self) -> None:
        """Frees vLLM's KV cache, and at levels 1 and 2 its weights, so that the trainer can use the memory."""
        if self.asleep:
            return
        if self.sleep_level == 0:
            # vLLM's own sleep frees every allocation of its pool, so the KV cache's are freed here, as its sleep
            # frees them (vllm/device_allocator/cumem.py), with its prompt cache emptied first.
            from vllm.device_allocator.cumem import unmap_and_release
            if self.llm.llm_engine.has_unfinished_requests():  # a generate cut short (vLLM's sleep aborts them)
                raise RuntimeError("vLLM still has unfinished requests: its KV cache cannot be freed")
            self.llm.reset_prefix_cache()
            torch.cuda.synchronize()  # nothing may still use the KV cache
            for allocation in self._allocations("kv_cache"):
                unmap_and_release(allocation.handle)
                allocation.is_asleep = True
        else:
            self.llm.sleep(level=self.sleep_level)
        self.asleep, self.slept_at = True, self.sleep_level  # waking follows slept_at, even if sleep_level changes

    def _wake_for_generation(self) -> None:
        if self.asleep:  # rollout without a sync since the last sleep: the last synced weights are still good
            if self.slept_at == 2:
                raise RuntimeError("the engine slept at level 2 and has no weights: call update_weights first")
            if self.slept_at == 1:
                self._make_room("weights")
                self.llm.wake_up(tags=["weights"])
            self._wake_kv_cache()

    def _wake_kv_cache(self) -> None:
        self._make_room("kv_cache")
        if self.slept_at == 0:
            from vllm.device_allocator.cumem import create_and_map
            for allocation in self._allocations("kv_cache"):
                create_and_map(allocation.handle)
                allocation.is_asleep = False
            self.worker.model_runner.post_kv_cache_wake_up()  # what vLLM's wake-up does after mapping the cache
        else:
            self.llm.wake_up(tags=["kv_cache"])
        self.asleep = False

    @staticmethod
    def _allocations(tag: str) -> list:
        """vLLM's memory of one kind ("weights" or "kv_cache"): the allocations its sleep frees and wake-up maps."""
        from vllm.device_allocator.cumem import CuMemAllocator
        return [a for a in CuMemAllocator.get_instance().pointer_to_data.values() if a.tag == tag]

    @staticmethod
    def _allocated_bytes(tag: str) -> int:
        return sum(a.handle[1] for a in VLLMRolloutEngine._allocations(tag))

    def _make_room(self, tag: str) -> None:
        """Empties PyTorch's cache of the trainer's freed blocks only if vLLM's memory of this kind would not fit
        beside it (with 1 GiB to spare). Otherwise, after a level-0 sleep, the trainer keeps its blocks for the next
        step, and the same process's vLLM reuses them for its activations (vLLM's own sleep, levels 1 and 2, empties
        the cache anyway)."""
        if torch.cuda.mem_get_info()[0] < self._allocated_bytes(tag) + 2**30:
            torch.cuda.empty_cache()

    def check_weights(self, model: torch.nn.Module) -> None:
        """Collective: raises RuntimeError naming the first mismatching tensors (see check_weight_sync)."""
        if self.asleep:
            raise RuntimeError("check_weights reads vLLM's weights: call it after update_weights, before sleep")
        slot = None
        if self.lora_request is not None:  # the adapters' GPU slot in vLLM's LoRA layers
            slot = self.vllm_model.lora_manager.lora_index_to_id.index(self.lora_request.lora_int_id)
        check_weight_sync(model, self.vllm_model, lora_slot=slot)


def to_completion(output) -> Completion:
    """One vLLM CompletionOutput -> Completion: the sampled tokens (a stop token included) and their log-probs
    under the processed (temperature, top-p) distribution. With logprobs=0 each position holds only the sampled
    token's entry, first; flat_logprobs stores them as one list (FlatLogprobs), else as one dict per position.
    With enable_return_routed_experts, vLLM returns the experts of the prompt's tokens and of every token it fed
    back (all sampled ones but the last), [prompt + response - 1, layers, top_k] (zeros for dense layers)."""
    lp = output.logprobs
    if lp is None:  # not asked for
        logprobs = None
    elif hasattr(lp, "start_indices"):
        logprobs = [lp.logprobs[start] for start in lp.start_indices]
    else:
        logprobs = [position[token].logprob for position, token in zip(lp, output.token_ids)]
    routes = getattr(output, "routed_experts", None)  # [prompt + response - 1, layers, top_k], uint8 or uint16
    if routes is not None:
        routes = torch.from_numpy(routes.astype("int16"))
    return Completion(response_ids=list(output.token_ids), logprobs=logprobs, finished=output.finish_reason == "stop",
                      routes=routes)
