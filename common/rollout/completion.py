"""What a rollout engine returns for one sampled response, whichever engine sampled it.

A module of its own so that both engines (common/rollout/engines.py, common/rollout/vllm_engine.py) import it and neither imports
the other for it: the engine factory in engines.py imports the vLLM engine, never the other way round.
"""

from dataclasses import dataclass


@dataclass
class Completion:
    response_ids: list[int]
    logprobs: list[float] | None  # log-prob of each sampled token under the sampling distribution (after
    # temperature); None where generate was called with logprobs=False
    finished: bool  # ended on a stop token (False: cut at max_tokens)
    routes: object = None  # MoE with --routing-replay: the experts each token went through, [prompt + response - 1,
    # layers, top_k] (vLLM's layout: the last token never went through the model), as a torch int16 tensor


@dataclass
class Request:
    """One response to generate, or to go on generating, in a partial rollouts' phase (common/rollout/partial.py).

    prompt_ids: the prompt and the response's tokens so far (re-prefilled under the engine's current weights);
    max_tokens: what is left of the response's budget. seed and position (the tokens already generated) name each
    sampled token's random draw on the HF engine, so that a response continued in a later phase under unchanged
    weights samples exactly what it would have in one go."""
    key: object
    prompt_ids: list[int]
    max_tokens: int
    seed: int
    position: int = 0
