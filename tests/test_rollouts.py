"""common/rollout/rollouts.py: when the colocated engine takes the policy's weights.

The placements end to end (colocated, split, async, resume) are tested through the scripts (test_grpo_e2e.py,
test_split.py, test_resume.py); here, the rule that a GPU run depends on and a CPU run (HF engine) never exercises:
a vLLM engine that dropped its weights while asleep (level 2) is synced again before it next generates; and on
which steps a rollout asks the engine for its log-probs.
"""

from types import SimpleNamespace

import pytest
import torch

from common.rollout.args import sequences_at_once, wants_rollout_logprobs
from common.rollout.rollouts import ColocatedRollouts
from common.run.logger import StageTimer


class CountingEngine:
    """Stands in for a vLLM engine: counts the syncs it receives."""

    def __init__(self, sleep_level: int):
        self.sleep_level, self.syncs = sleep_level, 0

    def sleep(self):
        pass

    def update_weights(self, policy):
        self.syncs += 1
        return {}


def colocated_rollouts(engine) -> ColocatedRollouts:
    """The colocated sync bookkeeping of a Rollouts, without a model or data."""
    rollouts = ColocatedRollouts.__new__(ColocatedRollouts)
    rollouts.engine, rollouts.policy, rollouts.timer = engine, None, StageTimer(torch.device("cpu"))
    rollouts.args = SimpleNamespace(check_weight_sync=False)
    rollouts.version, rollouts.synced_version = 0, -1
    return rollouts


@pytest.mark.parametrize("level, syncs_after_eval", [(0, 1), (1, 1), (2, 2)])
def test_an_engine_that_dropped_its_weights_is_synced_again(level, syncs_after_eval):
    rollouts = colocated_rollouts(CountingEngine(level))
    rollouts._sync()
    rollouts._sync()  # the same version: nothing to send
    assert rollouts.engine.syncs == 1
    # An evaluation of version 0 synced it; the rollout after it needs the same version. At level 1 the parked
    # weights come back on wake-up; at level 2 they were dropped and must be sent again.
    rollouts._sleep()
    rollouts._sync()
    assert rollouts.engine.syncs == syncs_after_eval
    rollouts.version = 1  # an update: every level syncs
    rollouts._sync()
    assert rollouts.engine.syncs == syncs_after_eval + 1


def test_engine_logprobs_are_asked_for_where_they_are_used():
    steps = range(1, 31)
    asked = lambda **args: [step for step in steps if wants_rollout_logprobs(SimpleNamespace(**args), step)]
    assert asked(tis_cap=None, logprob_diff_every=10) == [1, 11, 21]  # the metric, from the first step
    assert asked(tis_cap=None, logprob_diff_every=1) == list(steps)
    assert asked(tis_cap=None, logprob_diff_every=0) == []
    assert asked(tis_cap=2.0, logprob_diff_every=0) == list(steps)  # the loss needs them every step
    assert asked() == []  # a script without either flag (online DPO)


def test_the_kv_cache_is_sized_for_a_replicas_sequences():
    args = lambda tp=1: SimpleNamespace(rollout_tp=tp, prompts_per_step=32, group_size=8)
    assert sequences_at_once(args(), world=1, num_eval=128) == 256  # 32 prompts x 8 responses
    assert sequences_at_once(args(), world=2, num_eval=128) == 128  # each rank's engine: 16 x 8
    assert sequences_at_once(args(tp=2), world=2, num_eval=128) == 256  # one replica of two ranks takes both shares
    assert sequences_at_once(args(), world=1, num_eval=300) == 300  # an evaluation of more prompts than that
    assert sequences_at_once(args(), world=4, num_eval=301) == 76  # 64 a step, ceil(301 / 4) held-out prompts
