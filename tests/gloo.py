"""Helpers for tests that run gloo process groups on CPU (launcher.spawn: ranks forked from a pre-imported process)."""

import os
import socket

import torch
import torch.distributed as dist

from common.run.distributed import finish_distributed


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_gloo(rank: int, world: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)  # two cores shared by all ranks


def finish_gloo() -> None:
    """Ends a spawned rank. gloo aborts a rank whose peer tears down first, and a background C++ thread can abort
    the interpreter's shutdown ("terminate called without an active exception"): so barrier, destroy, and leave
    with os._exit once every result is written (what split-placement runs of grpo.py do too)."""
    finish_distributed(exit_process=True)
