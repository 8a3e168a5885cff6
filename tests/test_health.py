"""The health line before the first step (common/run/health.py): what it measures and when it warns."""

import os

import launcher
from gloo import finish_gloo, free_port, init_gloo

from common.run.health import health_report, layout_note, state_bytes


def health_worker(rank: int, port: int, out: str):
    import torch
    init_gloo(rank, 2, port)
    small = health_report(torch.device("cpu"), out, num_params=1000)
    huge = health_report(torch.device("cpu"), out, num_params=10**15)  # 12 PB a state: no disk holds two
    if rank == 0:
        with open(os.path.join(out, "report.txt"), "w") as f:
            f.write("\n".join(["SMALL", *small, "HUGE", *huge]))
    finish_gloo()


def test_a_state_is_weights_and_two_adam_moments_in_fp32():
    assert state_bytes(1_000_000) == 12_000_000


def test_health_line_measures_the_link_and_warns_of_a_full_disk(tmp_path):
    launcher.spawn(health_worker, args=(free_port(), str(tmp_path)), nprocs=2)
    small, huge = (tmp_path / "report.txt").read_text().split("\nHUGE\n")
    small = small.split("\n")[1:]
    assert len(small) == 1 and small[0].startswith("health: 2 CPU processes (gloo); FSDP over 2 ranks on 1 node; "
                                                    "all-reduce ")
    assert "GB/s bus bandwidth (one node)" in small[0] and "a training state about 0.0 MB" in small[0]
    assert float(small[0].split("all-reduce ")[1].split()[0]) > 0
    line, warning = huge.split("\n")
    assert line.startswith("health: ") and "a training state about 12000000.0 GB" in line
    assert warning.startswith(f"warning: {tmp_path} has ") and "room for fewer than two training states" in warning


def test_the_disk_warning_starts_below_two_states(tmp_path, monkeypatch):
    """room for 1.5 states warns, room for 2.5 does not (pins the 'fewer than two' threshold)."""
    import shutil
    from collections import namedtuple

    import torch
    import torch.distributed as dist
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**10, 0, 3 * 10**9))  # 3 GB free
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        tight = health_report(torch.device("cpu"), str(tmp_path), num_params=2 * 10**9 // 12)  # 2 GB a state
        roomy = health_report(torch.device("cpu"), str(tmp_path), num_params=12 * 10**8 // 12)  # 1.2 GB a state
    finally:
        dist.destroy_process_group()
    assert len(tight) == 2 and "room for fewer than two training states" in tight[1], tight
    assert len(roomy) == 1, roomy


def test_layout_note_from_the_flags():
    """--shard-size and --sequence-parallel as the health line describes them, by hand."""
    assert layout_note(4, 1, None, 1) == layout_note(4, 1, 4, 1) == "FSDP over 4 ranks on 1 node"
    hybrid = "hybrid FSDP: sharded within each of 2 groups of 2 ranks, replicated across them on 2 nodes"
    assert layout_note(4, 2, 2, 1) == hybrid
    replicated = "FSDP replicated on each of 4 ranks (--shard-size 1: no sharding) on 1 node, sequences split over " \
                 "groups of 2"
    assert layout_note(4, 1, 1, 2) == replicated
