"""Training-state checkpoints: save -> load restores everything exactly (on the same and on a different number of
gloo ranks), incomplete or damaged checkpoints are never picked, pruning, --resume resolution, new flags applied
on resume, the bad-step counter, and the Slurm launcher's rendezvous / preemption / requeue path on one machine."""

import json
import os
import random
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
import torch.distributed as dist
from transformers import Qwen2Config, Qwen2ForCausalLM

from common.data.prompts import PromptSampler
from common.run.checkpoints import BadStepCounter, set_hyperparameters
from common.run.resume import (checkpoint_damage, latest_checkpoint, load_training_state, newest_intact_checkpoint,
                           prune_checkpoints, read_trainer_state, resolve_resume, save_training_state)
from common.train.model import shard_model
from common.train.optim import is_bad_number
import launcher
from gloo import finish_gloo, free_port, init_gloo

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CPU = torch.device("cpu")
ROWS = [{"prompt": f"p{i}", "answer": str(i)} for i in range(10)]
PROMPTS_PER_STEP = 4  # global: 4 per rank on 1 rank, 2 per rank on 2 ranks



def tiny_model(seed: int):
    torch.manual_seed(seed)
    config = Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=40, max_position_embeddings=64, tie_word_embeddings=True)
    return Qwen2ForCausalLM(config)


def build(seed: int, rank: int, world: int):
    model = shard_model(tiny_model(seed), CPU)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 4))
    sampler = PromptSampler(ROWS, PROMPTS_PER_STEP // world, rank, world, seed=3)
    return model, optimizer, scheduler, sampler


def train_step(model, optimizer, scheduler, rank: int, step: int):
    ids = torch.randint(0, 40, (2, 6), generator=torch.Generator().manual_seed(100 * step + rank))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()


def snapshot(model, optimizer, scheduler, sampler) -> dict:
    """Full (gathered) weights and AdamW state, scheduler, the next global prompt batch, then fresh RNG draws."""
    names = {p: n for n, p in model.named_parameters()}
    weights = {n: p.full_tensor().clone() for n, p in model.named_parameters()}
    adam = {f"{names[p]}.{k}": (v.full_tensor() if hasattr(v, "full_tensor") else v).clone()
            for p, s in optimizer.state.items() for k, v in s.items()}
    next_batch = [None] * dist.get_world_size()
    dist.all_gather_object(next_batch, [row["prompt"] for row in sampler.next_batch()])
    return {"weights": weights, "adam": adam, "scheduler": scheduler.state_dict(),
            "lr": optimizer.param_groups[0]["lr"], "next_global_batch": sum(next_batch, []),
            "draws": [random.random(), float(np.random.rand()), torch.rand(3).tolist()]}


def save_run(rank: int, world: int, root: str):
    model, optimizer, scheduler, sampler = build(seed=0, rank=rank, world=world)
    for _ in range(3):
        sampler.next_batch()
    train_step(model, optimizer, scheduler, rank, step=1)
    # A stale save of step 2 first: saving step 2 again must replace it.
    save_training_state(root, 2, model, optimizer, scheduler, sampler, {"wandb_run_id": "stale"})
    train_step(model, optimizer, scheduler, rank, step=2)
    torch.manual_seed(1234 + rank)
    path = save_training_state(root, 2, model, optimizer, scheduler, sampler, {"wandb_run_id": "abc123"})
    torch.save(snapshot(model, optimizer, scheduler, sampler), os.path.join(root, f"saved_rank{rank}.pt"))
    if rank == 0:
        # What a killed save leaves behind: later steps, but not loadable.
        os.makedirs(os.path.join(root, "state_000009.tmp"))
        open(os.path.join(root, "state_000009.tmp", "COMPLETE"), "w").close()  # marked but never renamed
        os.makedirs(os.path.join(root, "state_000010"))  # renamed by hand, no marker
        assert path == os.path.join(root, "state_000002")


def load_run(rank: int, world: int, root: str, out: str):
    model, optimizer, scheduler, sampler = build(seed=1, rank=rank, world=world)  # other weights, empty AdamW
    path = resolve_resume("auto", root)
    info = load_training_state(path, model, optimizer, scheduler, sampler)
    torch.save({"path": path, "info": info, **snapshot(model, optimizer, scheduler, sampler)},
               os.path.join(out, f"loaded_{os.path.basename(root)}_on_{world}_rank{rank}.pt"))


def resume_worker(rank: int, world: int, port: int, save_root: str | None, load_roots: list[str], out: str):
    init_gloo(rank, world, port)
    if save_root is not None:
        save_run(rank, world, save_root)
    for root in load_roots:
        load_run(rank, world, root, out)
    finish_gloo()


@pytest.fixture(scope="module")
def resumed(tmp_path_factory) -> str:
    """Runs saved on 2 and on 1 rank, each loaded on 2 and on 1 rank; three launches, as each costs seconds."""
    out = str(tmp_path_factory.mktemp("resume"))
    saved_on = {world: os.path.join(out, f"saved_on_{world}") for world in (1, 2)}
    launcher.spawn(resume_worker, args=(2, free_port(), saved_on[2], [], out), nprocs=2)
    launcher.spawn(resume_worker, args=(1, free_port(), saved_on[1], [saved_on[2]], out), nprocs=1)
    launcher.spawn(resume_worker, args=(2, free_port(), None, [saved_on[1], saved_on[2]], out), nprocs=2)
    return out


@pytest.mark.parametrize("saved_world, load_world", [(2, 2), (2, 1), (1, 2)])
def test_resume_restores_training_state(resumed, saved_world, load_world):
    root = os.path.join(resumed, f"saved_on_{saved_world}")
    before = torch.load(os.path.join(root, "saved_rank0.pt"))
    for rank in range(load_world):
        after = torch.load(os.path.join(resumed, f"loaded_saved_on_{saved_world}_on_{load_world}_rank{rank}.pt"))
        assert after["path"] == os.path.join(root, "state_000002")  # not the unmarked state_000009.tmp / 000010
        assert after["info"]["step"] == 2 and after["info"]["extra"] == {"wandb_run_id": "abc123"}
        assert after["info"]["saved_world_size"] == saved_world
        assert read_trainer_state(after["path"])["extra"] == {"wandb_run_id": "abc123"}
        assert set(after["weights"]) == set(before["weights"]) and set(after["adam"]) == set(before["adam"])
        for name, weight in before["weights"].items():
            assert torch.equal(after["weights"][name], weight), name
        assert any(k.endswith("exp_avg") for k in before["adam"])
        for name, value in before["adam"].items():  # exp_avg, exp_avg_sq, step: all exact
            assert torch.equal(after["adam"][name], value), name
        assert after["scheduler"] == before["scheduler"] and after["lr"] == before["lr"]
        assert after["next_global_batch"] == before["next_global_batch"]  # same prompts at any world size
        if saved_world == load_world:
            assert after["info"]["exact_rng"]
            assert after["draws"] == torch.load(os.path.join(root, f"saved_rank{rank}.pt"))["draws"]
        else:
            assert not after["info"]["exact_rng"]  # seeded from (step, rank) instead


def make_checkpoint(root, step: int, complete: bool = True, suffix: str = ""):
    path = root / f"state_{step:06d}{suffix}"
    path.mkdir(parents=True)
    if complete:
        (path / "COMPLETE").write_text("ok\n")
    return path


def test_latest_checkpoint_skips_unfinished_saves(tmp_path):
    assert latest_checkpoint(str(tmp_path / "missing")) is None
    assert latest_checkpoint(str(tmp_path)) is None
    make_checkpoint(tmp_path, 1)
    make_checkpoint(tmp_path, 2)
    make_checkpoint(tmp_path, 3, complete=False)  # killed before its marker
    make_checkpoint(tmp_path, 4, suffix=".tmp")  # marked, killed before the rename
    make_checkpoint(tmp_path, 5, suffix=".old")
    (tmp_path / "hf_step_9").mkdir()
    assert latest_checkpoint(str(tmp_path)) == str(tmp_path / "state_000002")
    make_checkpoint(tmp_path, 10)  # numeric order, not only string order
    assert latest_checkpoint(str(tmp_path)) == str(tmp_path / "state_000010")


def test_prune_keeps_newest_complete_checkpoints(tmp_path):
    for step in (1, 2, 3, 4, 5):
        make_checkpoint(tmp_path, step)
    make_checkpoint(tmp_path, 6, suffix=".tmp")
    (tmp_path / "hf_step_5").mkdir()
    prune_checkpoints(str(tmp_path), keep=0)  # keeps every complete one, removes what a killed save left
    assert len(os.listdir(tmp_path)) == 6 and not (tmp_path / "state_000006.tmp").exists()
    prune_checkpoints(str(tmp_path), keep=2)
    assert sorted(os.listdir(tmp_path)) == ["hf_step_5", "state_000004", "state_000005"]
    prune_checkpoints(str(tmp_path), keep=2)
    assert sorted(os.listdir(tmp_path)) == ["hf_step_5", "state_000004", "state_000005"]


def test_resolve_resume(tmp_path):
    assert resolve_resume("auto", str(tmp_path / "new_run")) is None
    assert resolve_resume("none", str(tmp_path)) is None and resolve_resume("", str(tmp_path)) is None
    good = make_checkpoint(tmp_path, 7)
    assert resolve_resume("auto", str(tmp_path)) == str(good)
    assert resolve_resume(str(good), "elsewhere") == str(good)
    with pytest.raises(FileNotFoundError, match="state_000099"):
        resolve_resume(str(tmp_path / "state_000099"), str(tmp_path))
    half = make_checkpoint(tmp_path, 8, complete=False)
    with pytest.raises(ValueError, match="not a complete checkpoint"):
        resolve_resume(str(half), str(tmp_path))
    with pytest.raises(ValueError, match="did you mean .*state_000007"):  # the run directory instead of a checkpoint
        resolve_resume(str(tmp_path), "elsewhere")


def test_damaged_checkpoints_are_recognised_and_skipped(tmp_path):
    """The COMPLETE marker lists each file's size: a deleted or truncated file makes the state damaged, and
    --resume auto falls back to the newest intact one with a warning naming the damaged directory."""
    def state(step: int, files: dict) -> str:
        path = tmp_path / f"state_{step:06d}"
        path.mkdir()
        for name, data in files.items():
            (path / name).write_bytes(data)
        (path / "COMPLETE").write_text(json.dumps({"files": {n: len(d) for n, d in files.items()}}))
        return str(path)

    files = {"__0_0.distcp": b"x" * 100, "trainer_state.json": b"{}"}
    old, middle, new = state(2, files), state(4, files), state(6, files)
    assert checkpoint_damage(new) is None and newest_intact_checkpoint(str(tmp_path)) == (new, [])
    os.truncate(os.path.join(new, "__0_0.distcp"), 10)
    os.remove(os.path.join(middle, "trainer_state.json"))
    assert checkpoint_damage(new) == "__0_0.distcp has 10 bytes instead of 100"
    assert checkpoint_damage(middle) == "trainer_state.json is missing"
    path, warnings = newest_intact_checkpoint(str(tmp_path))
    assert path == old and len(warnings) == 2
    assert new in warnings[0] and "__0_0.distcp" in warnings[0] and middle in warnings[1]
    with pytest.raises(ValueError, match="damaged"):
        resolve_resume(new, str(tmp_path))
    make_checkpoint(tmp_path, 8)  # a marker from before manifests ("ok"): nothing to check, trusted
    assert newest_intact_checkpoint(str(tmp_path))[0] == str(tmp_path / "state_000008")


def test_resumed_optimizer_takes_this_launchs_learning_rate():
    """A state saved with lr 1e-2 and weight decay 0.1, three updates into a 4-step warmup, resumed with lr 1e-3 and
    no weight decay: the schedule keeps its position, the values are the new flags' (lr x 4/4 by hand)."""
    def build_optimizer():
        optimizer = torch.optim.AdamW(torch.nn.Linear(2, 2).parameters(), lr=1e-2, weight_decay=0.1)
        return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 4))

    optimizer, scheduler = build_optimizer()
    for _ in range(3):
        optimizer.step()
        scheduler.step()
    saved = scheduler.state_dict(), optimizer.state_dict()
    optimizer, scheduler = build_optimizer()
    scheduler.load_state_dict(saved[0])
    optimizer.load_state_dict(saved[1])
    assert optimizer.param_groups[0]["lr"] == pytest.approx(1e-2)
    set_hyperparameters(optimizer, scheduler, lr=1e-3, weight_decay=0.0)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(1e-3) and scheduler.get_last_lr() == [pytest.approx(1e-3)]
    assert optimizer.param_groups[0]["weight_decay"] == 0.0
    scheduler.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(1e-3)


def test_bad_step_counter():
    assert is_bad_number(float("nan")) and is_bad_number(torch.tensor(float("-inf"))) and not is_bad_number(3.0)
    counter = BadStepCounter(max_bad_steps=3)
    for step, bad in enumerate([True, True, False, True, True], start=1):  # a good step resets the run of bad ones
        counter.record(bad, step)
    assert counter.in_a_row == 2 and counter.total == 4
    with pytest.raises(RuntimeError, match="3 steps in a row"):
        counter.record(True, step=6)
    with pytest.raises(ValueError):
        BadStepCounter(0)


# ---------------------------------------------------------------------------------------------------------------
# The Slurm launcher on one machine: stand-ins for srun / scontrol / scancel run one torchrun per "node" here,
# so the real script, its rendezvous flags and its preemption path run as they would on a cluster.

FAKE_SRUN = """#!/bin/bash
while [[ $1 == --* ]]; do shift; done  # srun's own options
for ((node = 0; node < SLURM_NNODES; node++)); do
    SLURM_NODEID=$node SLURM_PROCID=$node "$@" &
    echo $! >> "$FAKE_SLURM_DIR/task_pids"
done
status=0
for pid in $(jobs -p); do wait "$pid" || status=$?; done
exit $status
"""
FAKE_SCONTROL = """#!/bin/bash
case $1 in
    show) printf '127.0.0.1\\nnode-2\\n' ;;  # show hostnames: the first one hosts the rendezvous
    requeue) echo "$2" >> "$FAKE_SLURM_DIR/requeued" ;;
esac
"""
FAKE_SCANCEL = """#!/bin/bash
for pid in $(cat "$FAKE_SLURM_DIR/task_pids"); do kill -s "${1#--signal=}" "$pid"; done
"""
TRAIN_STUB = """
import os, sys, time
import torch, torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from common.run.distributed import finish_distributed
from common.run.resume import load_training_state, resolve_resume, save_training_state
from common.run.signals import install_stop_handlers, stop_agreed, stop_requested

output_dir, max_steps = sys.argv[1], int(sys.argv[2])
install_stop_handlers()
dist.init_process_group("gloo")
torch.set_num_threads(1)
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
model = fully_shard(torch.nn.Linear(8, 8))
optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
path, step = resolve_resume("auto", output_dir), 0
if path:
    step = load_training_state(path, model, optimizer, None, None)["step"]
print(f"rank {rank} of {world} on node {os.environ['SLURM_NODEID']} starts at step {step}", flush=True)
while step < max_steps and not stop_agreed(torch.device("cpu")):
    model(torch.randn(4, 8)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()
    step += 1
    open(os.path.join(output_dir, f"running_rank{rank}"), "w").close()
    time.sleep(0.05)
save_training_state(output_dir, step, model, optimizer, None, None, {"signal": stop_requested()})
print(f"rank {rank} saved step {step}, signal {stop_requested()}", flush=True)
finish_distributed(exit_process=True)  # a gloo thread can abort the interpreter's shutdown under load
"""


@pytest.fixture
def fake_slurm(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in {"srun": FAKE_SRUN, "scontrol": FAKE_SCONTROL, "scancel": FAKE_SCANCEL,
                       "torchrun": f"#!/bin/bash\nexec {sys.executable} -m torch.distributed.run \"$@\"\n"}.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    (tmp_path / "train_stub.py").write_text(TRAIN_STUB)
    (tmp_path / "out").mkdir()
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHONPATH": ROOT, "FAKE_SLURM_DIR": str(tmp_path),
           "SLURM_JOB_ID": "4242", "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "node-[1-2]", "GPUS_PER_NODE": "1",
           "MASTER_PORT": str(free_port()), "TRAIN_SCRIPT": str(tmp_path / "train_stub.py"), "OMP_NUM_THREADS": "1"}

    def launch(*args) -> subprocess.Popen:
        (tmp_path / "task_pids").unlink(missing_ok=True)
        return subprocess.Popen(["bash", os.path.join(ROOT, "scripts", "slurm_grpo.sh"), *args], cwd=tmp_path,
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return launch, tmp_path


@pytest.mark.faults  # a signal to the whole launch: the fault-tolerance step (pytest.ini)
def test_slurm_launcher_time_limit_saves_requeues_and_resumes(fake_slurm):
    launch, tmp_path = fake_slurm
    job = launch(str(tmp_path / "out"), "100000")
    deadline = time.time() + 90
    while not all((tmp_path / "out" / f"running_rank{r}").exists() for r in range(2)):
        assert job.poll() is None and time.time() < deadline, job.communicate()[0]
        time.sleep(0.2)
    job.send_signal(signal.SIGUSR1)  # what `#SBATCH --signal=B:USR1@...` sends before the time limit
    out, _ = job.communicate(timeout=120)
    assert job.returncode == 0, out
    assert "rendezvous at 127.0.0.1:" in out
    assert "rank 0 of 2 on node 0 starts at step 0" in out and "rank 1 of 2 on node 1 starts at step 0" in out, out
    assert (tmp_path / "requeued").read_text().split() == ["4242"], out
    checkpoint = latest_checkpoint(str(tmp_path / "out"))
    assert checkpoint is not None and "signal SIGTERM" in out, out
    saved_step = int(checkpoint.rsplit("_", 1)[1])
    # The requeued job: same command, resumes where the first one stopped.
    out, _ = launch(str(tmp_path / "out"), str(saved_step + 2)).communicate(timeout=120)
    assert f"rank 0 of 2 on node 0 starts at step {saved_step}" in out, out
    assert "rank 1 of 2 on node 1 starts at step" in out
    assert latest_checkpoint(str(tmp_path / "out")).endswith(f"state_{saved_step + 2:06d}")
