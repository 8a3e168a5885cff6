"""Split placement and async rollouts (common/rollout/split.py, grpo.py --rollout-ranks / --async-rollout): the version
schedule and the correction math by hand, the link's messages and weight buckets between real processes, and
grpo.py end to end with trainer and rollout ranks."""

import json
import math
import os
import re
import signal
import time

import pytest
import torch
import torch.distributed as dist

from common.train.off_policy import mismatch_metrics
from common.rollout.split import (behaviour_version, check_shapes, eval_versions, plan_buckets, recv_object,
                                  recv_weights, send_object, staleness_metrics, weight_versions)
import launcher
from gloo import finish_gloo, free_port, init_gloo
from test_grpo_e2e import launch, torchrun, wait_for


def test_behaviour_versions_lag_by_the_staleness():
    # Synchronous: batch k comes from the weights after k - 1 updates.
    assert [behaviour_version(k, 0, 0) for k in range(1, 5)] == [0, 1, 2, 3]
    # One-step off-policy: batch k + 1 is generated while batch k trains, so with the weights before that update.
    assert [behaviour_version(k, 0, 1) for k in range(1, 6)] == [0, 0, 1, 2, 3]
    assert [behaviour_version(k, 0, 2) for k in range(1, 6)] == [0, 0, 0, 1, 2]
    # A resumed run starts from the checkpoint's weights: nothing older exists.
    assert [behaviour_version(k, 10, 1) for k in range(11, 14)] == [10, 10, 11]


def test_weight_schedule_sends_what_is_generated_with_or_evaluated():
    assert eval_versions(0, 6, 3) == [0, 3, 6]
    assert eval_versions(4, 6, 3) == [6]  # a resumed run evaluated its start before it stopped
    # 6 steps, async: batches use versions 0,0,1,2,3,4; versions 3 and 6 are evaluated; 5 is never needed.
    assert weight_versions(0, 6, 1, 3) == [0, 1, 2, 3, 4, 6]
    assert weight_versions(0, 6, 0, 0) == [0, 1, 2, 3, 4, 5, 6]  # sync: every version (the last for evaluation)
    assert weight_versions(4, 6, 1, 0) == [4, 6]  # resumed at 4: batches 5 and 6 both use version 4


def test_staleness_bookkeeping():
    assert staleness_metrics([3, 3, 2], trainer_version=3, max_staleness=1) == {"staleness_sum": 1.0,
                                                                                 "staleness_max": 1.0}
    with pytest.raises(RuntimeError, match="staleness must be in"):
        staleness_metrics([1, 3], trainer_version=3, max_staleness=1)
    with pytest.raises(RuntimeError, match="staleness must be in"):
        staleness_metrics([4], trainer_version=3, max_staleness=1)  # from the future: a bookkeeping bug


def test_truncated_importance_weights_by_hand():
    # Two sequences; ratios p_old / p_behaviour = exp(old - behaviour) = 1/2, 1, 3 (capped at 2), 4 (capped).
    old = [torch.tensor([math.log(0.25), math.log(0.5)]), torch.tensor([math.log(0.6), math.log(0.8)])]
    behaviour = [[math.log(0.5), math.log(0.5)], [math.log(0.2), math.log(0.2)]]
    samples = [dict(response_ids=[5, 6], old_logprobs=o, logprobs=b) for o, b in zip(old, behaviour)]
    samples.append(dict(response_ids=[5, 6], old_logprobs=torch.tensor([0.0, -9.0]), logprobs=None))  # not asked
    # A multi-turn episode: its second token is an observation (engine log-prob 0), not the model's: left out.
    samples.append(dict(response_ids=[5, 6], response_mask=[1, 0], old_logprobs=torch.tensor([math.log(0.5), -9.0]),
                        logprobs=[math.log(0.5), 0.0]))
    stats = mismatch_metrics(samples, cap=2.0)
    assert stats["lp_tokens"] == 5
    assert stats["lp_diff"] == pytest.approx(math.log(2) + 0 + math.log(3) + math.log(4) + 0, rel=1e-6)
    assert stats["tis_weight_sum"] == pytest.approx(0.5 + 1 + 2 + 2 + 1, rel=1e-6)
    assert stats["tis_capped"] == 2
    assert stats["tis_ratio_max"] == pytest.approx(4.0, rel=1e-6)


def test_mismatched_weight_lists_are_caught():
    shapes = [("a", torch.Size([3, 2])), ("b", torch.Size([5]))]
    check_shapes(shapes, list(shapes), 0)
    with pytest.raises(ValueError, match="rollout rank 1 expects other weights"):
        check_shapes(shapes, [("a", torch.Size([2, 3])), ("b", torch.Size([5]))], 1)
    with pytest.raises(ValueError, match="rollout rank 0"):
        check_shapes(shapes, shapes[:1], 0)


def test_buckets_close_before_the_limit():
    assert plan_buckets([4, 4, 4], 8) == [[0, 1], [2]]
    assert plan_buckets([10, 2, 2, 9], 8) == [[0], [1, 2], [3]]  # a tensor over the limit goes alone
    assert plan_buckets([], 8) == []


def test_colocated_sync_streams_the_same_buckets():
    """sync_weights_to_vllm (colocated) and the split link's receivers group the weights by one rule."""
    from types import SimpleNamespace

    from transformers import Qwen2Config, Qwen2ForCausalLM

    from sharding.vllm_sync import sync_weights_to_vllm, weight_shapes
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=100,
                                         tie_word_embeddings=True))
    loaded = []
    receiver = SimpleNamespace(config=model.config, load_weights=lambda bucket: loaded.append(list(bucket)))
    limit_mb = 0.01  # about 10 kB: several buckets, and the 6.4 kB embedding alone
    total = sync_weights_to_vllm(model, receiver, bucket_mb=limit_mb, dtype=torch.bfloat16)
    shapes = weight_shapes(model)
    expected = plan_buckets([size.numel() * 2 for _, size in shapes], limit_mb * 2**20)
    names = [name for name, _ in shapes]
    assert [[name for name, _ in bucket] for bucket in loaded] == [[names[i] for i in b] for b in expected]
    assert len(expected) > 2 and total == sum(size.numel() * 2 for _, size in shapes)
    params = dict(model.named_parameters())
    for bucket in loaded:
        for name, tensor in bucket:
            assert torch.equal(tensor, params[name].detach().to(torch.bfloat16))


def _link_worker(rank: int, port: int, out_dir: str):
    """Link rank 0 is the trainer, 1 and 2 rollout ranks: objects flow in, weights flow out in buckets."""
    from common.rollout.split import Placement, next_header, recv_header, send_header, send_weights
    init_gloo(rank, 3, port)
    link, weights = dist.new_group([0, 1, 2], backend="gloo"), dist.new_group([0, 1, 2], backend="gloo")
    placement = Placement("train" if rank == 0 else "rollout", rank, 3, 1, 2, link, weights,
                          dist.distributed_c10d._get_default_store())
    shapes = [("a", torch.Size([3, 2])), ("b", torch.Size([5])), ("c", torch.Size([2, 2]))]
    cpu = torch.device("cpu")
    if rank == 0:
        messages = [recv_object(link, 1), recv_object(link, 2)]
        tensors = [("a", torch.arange(6.0).view(3, 2)), ("b", torch.ones(5)), ("c", -torch.eye(2))]
        send_header(placement, 7, cpu)
        sent = send_weights(placement, iter(tensors), torch.float32, bucket_mb=0, device=cpu)
        out = dict(messages=messages, sent=sent)
    else:
        # The rollout side sends first and receives before its send has completed, as the async loop does.
        pending = send_object(link, {"from": rank, "samples": list(range(rank * 3))}, 0)
        while (announced := next_header(placement)) is None:  # the store has it before the broadcast starts
            time.sleep(0.01)
        version = recv_header(placement, cpu)
        assert announced == version and next_header(placement) is None  # (the next one is not announced yet)
        got, buckets = {}, []

        def load(bucket):
            buckets.append([name for name, _ in bucket])
            got.update({name: t.clone() for name, t in bucket})
        recv_weights(placement, shapes, torch.float32, bucket_mb=0, device=cpu, load=load)
        pending.wait()
        out = dict(version=version, got=got, buckets=buckets)
    torch.save(out, os.path.join(out_dir, f"{rank}.pt"))
    finish_gloo()


def test_link_carries_objects_in_and_weights_out(tmp_path):
    launcher.spawn(_link_worker, args=(free_port(), str(tmp_path)), nprocs=3)
    trainer = torch.load(tmp_path / "0.pt")
    assert trainer["messages"] == [{"from": 1, "samples": [0, 1, 2]}, {"from": 2, "samples": [0, 1, 2, 3, 4, 5]}]
    assert trainer["sent"] == (6 + 5 + 4) * 4
    for rank in (1, 2):
        rollout = torch.load(tmp_path / f"{rank}.pt")
        assert rollout["version"] == 7
        assert rollout["buckets"] == [["a"], ["b"], ["c"]]  # a zero-MB limit: one tensor per bucket
        torch.testing.assert_close(rollout["got"]["a"], torch.arange(6.0).view(3, 2))
        torch.testing.assert_close(rollout["got"]["b"], torch.ones(5))
        torch.testing.assert_close(rollout["got"]["c"], -torch.eye(2))


# ---------------------------------------------------------------------------------------------------------------
# grpo.py end to end.

def failure(result) -> str:
    """Where a failed run went wrong: the first fatal error or traceback in its output (else its end)."""
    text = result.stdout + result.stderr
    with open(f"/tmp/nanorl_split_failure_{os.getpid()}_{len(text)}.log", "w") as f:  # the whole output, for diagnosis
        f.write(text)
    starts = [text.find(m) for m in ("Fatal Python error", "terminate called", "Traceback") if m in text]
    return text[min(starts):][:4000] if starts else text[-3000:]


def read_metrics(path) -> list[dict]:
    return [json.loads(line) for line in open(path)]


def test_split_placement_syncs_exact_weights(tmp_path):
    """2 trainers + 2 rollout ranks, synchronous: the rollout ranks sample with exactly the trainers' weights, so
    their log-probs equal the trainers' (fp32 on CPU), and every batch is fresh (staleness 0)."""
    out = tmp_path / "run"
    result = torchrun(["--rollout-ranks", "2", "--steps", "4", "--eval-every", "2", "--eval-size", "32",
                       "--logprob-diff-every", "1", "--output-dir", str(out)], tmp_path, nproc=4)
    assert result.returncode == 0, failure(result)
    rows = read_metrics(out / "metrics.jsonl")
    steps = [r for r in rows if "reward/mean" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    diffs = [r["rollout/logprob_diff"] for r in steps if "rollout/logprob_diff" in r]  # absent: no group had signal
    assert diffs and all(d < 1e-5 for d in diffs), diffs
    assert all(r["rollout/staleness_max"] == 0 for r in steps)
    assert [r["eval/version"] for r in rows if "eval/version" in r] == [0, 2, 4]
    assert (out / "hf_step_4").exists()


def test_async_split_learns_the_builtin_task(tmp_path, builtin_sync_run):
    """1 rollout rank generating one step ahead of 2 trainers: every batch after the first is one update old, the
    correction is logged, and the held-out accuracy the synchronous run (the README's first command) has at step
    100 is reached within 1.5x its steps."""
    sync_result, sync_out = builtin_sync_run
    assert sync_result.returncode == 0, failure(sync_result)
    sync_evals = {r["step"]: r["eval/accuracy"] for r in read_metrics(sync_out / "metrics.jsonl")
                  if "eval/accuracy" in r}
    target = sync_evals[100]
    out = tmp_path / "run"
    result = torchrun(["--rollout-ranks", "1", "--async-rollout", "--steps", "150", "--output-dir", str(out)],
                      tmp_path, nproc=3, timeout=600)
    assert result.returncode == 0, failure(result)
    match = re.search(r"held-out greedy accuracy: ([\d.]+) before training -> ([\d.]+) after",
                      result.stdout + result.stderr)
    before, after = float(match.group(1)), float(match.group(2))
    assert before < 0.2 and after >= 0.8, (before, after)
    rows = read_metrics(out / "metrics.jsonl")
    evals = {r["eval/version"]: r["eval/accuracy"] for r in rows if "eval/version" in r}  # by the weights' version
    assert sorted(evals) == [*range(0, 151, 25)]
    reached = [version for version, accuracy in sorted(evals.items()) if accuracy >= target]
    assert reached and reached[0] <= 150, (target, sync_evals, evals)
    steps = [r for r in rows if "reward/mean" in r]
    assert steps[0]["rollout/staleness_mean"] == 0 and steps[0].get("rollout/logprob_diff", 0) < 1e-5
    assert all(r["rollout/staleness_mean"] == 1 and r["rollout/staleness_max"] == 1 for r in steps[1:])
    # One update behind: the behaviour log-probs differ from the trainer's, and the weights average about 1.
    scored = [r for r in steps[1:] if "rollout/logprob_diff" in r]  # steps where some group had signal
    assert len(scored) > len(steps) / 2 and sum(r["rollout/logprob_diff"] for r in scored) / len(scored) > 1e-3
    assert all(0.5 < r["tis/weight_mean"] <= 2.0 and 0 <= r["tis/capped_frac"] < 0.5 for r in steps
               if "tis/weight_mean" in r)


def test_staleness_two_resume_and_switching_placement(tmp_path):
    """Two batches in flight (no deadlock, staleness up to 2), every evaluation logged with its version, a resumed
    split run, one resumed at its end, and a split checkpoint resumed colocated; the rollout rank scores in a reward
    process."""
    out = tmp_path / "run"
    common = ["--rollout-ranks", "1", "--async-rollout", "--max-staleness", "2", "--eval-every", "3",
              "--eval-size", "32", "--save-state-every", "3", "--output-dir", str(out), "--reward-workers", "1"]
    result = torchrun([*common, "--steps", "6"], tmp_path, nproc=3)
    assert result.returncode == 0, failure(result)
    rows = read_metrics(out / "metrics.jsonl")
    steps = [r for r in rows if "reward/mean" in r]
    assert [r["rollout/staleness_max"] for r in steps] == [0, 1, 2, 2, 2, 2]
    assert [r["eval/version"] for r in rows if "eval/version" in r] == [0, 3, 6]

    result = torchrun([*common, "--steps", "9"], tmp_path, nproc=3)  # resumes from state_000006
    assert result.returncode == 0, failure(result)
    assert "resumed from" in result.stdout + result.stderr
    rows = read_metrics(out / "metrics.jsonl")
    resumed = [r for r in rows if "reward/mean" in r][6:]
    assert [r["step"] for r in resumed] == [7, 8, 9]
    assert [r["rollout/staleness_max"] for r in resumed] == [0, 1, 2]  # nothing older than the checkpoint
    assert [r["eval/version"] for r in rows if "eval/version" in r] == [0, 3, 6, 9]

    result = torchrun([*common, "--steps", "9"], tmp_path, nproc=3)  # already there: nothing to do
    assert result.returncode == 0 and "nothing to do" in result.stdout + result.stderr, failure(result)
    result = torchrun(["--steps", "10", "--eval-every", "0", "--eval-size", "32", "--output-dir", str(out)], tmp_path)
    assert result.returncode == 0, failure(result)  # colocated, from the split run's state_000009
    assert "resumed from" in result.stdout + result.stderr


# Where a stop signal arrives (NANORL_TEST_SIGNAL, common.run.signals.signal_point): the stage a process enters at a
# step, and whether every process of the launch gets SIGTERM (as under Slurm) or only the one that got there; then
# the flags that differ from an async run of 6 steps with one rollout rank.
IN_FLIGHT = ["--partial-rollouts", "--max-staleness", "2", "--max-response-len", "8"]
STOP_MOMENTS = {
    "during generation": ("generate:3", []),  # on the rollout rank; the trainers train batch 2 or wait for batch 3
    "while the trainers wait for a batch": ("rollout_wait:3", []),
    "during an update": ("update:3", []),
    "during a weight push": ("sync:3:rank=0", []),  # trainer 0 pushes version 3
    "during a save": ("save_state:2", []),  # --save-state-every 2: the periodic save of step 2
    "on the rollout rank alone": ("generate:3:self", []),  # the trainers learn it from the batch
    "on one trainer alone": ("update:3:self:rank=1", []),  # the others from stop_agreed, the rollout rank from STOP
    "one step before the end": ("update:5", []),  # the rollout rank already has what its last batch needs
    "two before the end, staleness 2": ("update:4", ["--max-staleness", "2"]),
    "synchronous": ("update:3", ["--no-async-rollout"]),
    # in-flight updates (--partial-rollouts): the rollout rank may be between two engine steps, taking a version
    "in-flight, during generation": ("generate:3", IN_FLIGHT),
    "in-flight, during an update": ("update:3", IN_FLIGHT),
    "in-flight, during a weight push": ("sync:3:rank=0", IN_FLIGHT),
    "in-flight, on the rollout rank alone": ("generate:3:self", IN_FLIGHT),
}


@pytest.mark.faults
@pytest.mark.parametrize("moment", STOP_MOMENTS)
def test_a_stop_signal_in_split_placement_loses_no_update(tmp_path, moment):
    """SIGTERM at any moment of an async split run: every rank finishes what it is doing, the trainers save the state
    of the last update they completed (the newest row of metrics.jsonl) and every process exits 0; the same command
    then continues from that state to the end, with every step's row exactly once."""
    from common.run.resume import latest_checkpoint, read_trainer_state
    out = tmp_path / "run"
    point, flags = STOP_MOMENTS[moment]
    command = ["--rollout-ranks", "1", "--async-rollout", "--steps", "6", "--save-state-every", "2", "--eval-every",
               "0", "--eval-size", "16", "--prompts-per-step", "8", "--group-size", "4", "--output-dir", str(out),
               "--reward-workers", "1", *flags]
    result = torchrun(command, tmp_path, nproc=3, env={"NANORL_TEST_SIGNAL": point})
    assert result.returncode == 0, failure(result)
    stopped = int(re.search(r"saved the training state at step (\d+)", result.stdout + result.stderr).group(1))
    steps = [r["step"] for r in read_metrics(out / "metrics.jsonl") if "reward/mean" in r]
    assert 2 <= stopped < 6 and steps == [*range(1, stopped + 1)], (stopped, steps)
    assert read_trainer_state(latest_checkpoint(str(out)))["step"] == stopped
    result = torchrun(command, tmp_path, nproc=3)
    assert result.returncode == 0, failure(result)
    assert f"at step {stopped}" in result.stdout + result.stderr
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl") if "reward/mean" in r] == [1, 2, 3, 4, 5, 6]


@pytest.mark.faults
@pytest.mark.parametrize("script", ["ppo.py", "dpo.py"])
def test_ppo_and_online_dpo_stop_the_same_way_in_split_placement(tmp_path, script):
    """The same rollout helper: SIGTERM to every process as the rollout rank starts batch 3 leaves the state of the
    last update (resuming it is grpo.py's test above: the same code)."""
    out = tmp_path / "run"
    command = [*(["--online"] if script == "dpo.py" else []), "--rollout-ranks", "1", "--async-rollout", "--steps",
               "5", "--save-state-every", "100", "--eval-every", "0", "--eval-size", "16", "--prompts-per-step", "8",
               "--group-size", "4", "--output-dir", str(out), "--reward-workers", "1"]
    result = torchrun(command, tmp_path, nproc=3, script=script, env={"NANORL_TEST_SIGNAL": "generate:3"})
    assert result.returncode == 0, failure(result)
    stopped = int(re.search(r"saved the training state at step (\d+)", result.stdout + result.stderr).group(1))
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl") if "policy/lr" in r] == [*range(1, stopped + 1)]
    from common.run.resume import latest_checkpoint, read_trainer_state
    assert 2 <= stopped < 5 and read_trainer_state(latest_checkpoint(str(out)))["step"] == stopped


@pytest.mark.faults
def test_sigterm_through_torchrun_in_split_placement(tmp_path):
    """torchrun passes SIGTERM to every rank, at a moment of its own: the run stops at a saved step and resumes."""
    from common.run.resume import latest_checkpoint, read_trainer_state
    out = tmp_path / "run"
    args = ["--rollout-ranks", "1", "--async-rollout", "--save-state-every", "0", "--eval-every", "0",
            "--eval-size", "32", "--output-dir", str(out), "--reward-workers", "1"]  # scored in a reward process
    proc = launch([*args, "--steps", "500"], tmp_path, nproc=3)
    wait_for(lambda: (out / "metrics.jsonl").exists() and len((out / "metrics.jsonl").read_text().splitlines()) >= 4,
             proc)
    proc.send_signal(signal.SIGTERM)
    output = proc.communicate(timeout=120)[0]
    assert "saved the training state" in output, output[-3000:]
    step = read_trainer_state(latest_checkpoint(str(out)))["step"]
    assert 3 <= step < 500
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl") if "reward/mean" in r] == [*range(1, step + 1)]
    result = torchrun([*args, "--steps", str(step + 2)], tmp_path, nproc=3)
    assert result.returncode == 0, failure(result)
    assert f"at step {step}" in result.stdout + result.stderr
