"""A hang ends: a rank that has made no progress for --hang-timeout seconds (one stage of a step, or the gap between
two, never finished) writes the Python stack of every thread to <output_dir>/hangs/rank<N>.txt, one line over all
ranks names the stage, the step and the ranks that did not get there, and the process exits with code 1, so that
`torchrun --max-restarts` or Slurm starts the run again from its newest state instead of waiting for ever.

Progress is what common.run.logger.StageTimer sees: a step's start and each stage's start and end, from the loop's first
step on, and before it the stages of step 0 (the first sync and evaluation); a wait for the other side of split
placement is not counted (that side watches its own work). Each rank also
writes where it is (step and stage) to torchrun's key-value store, which outlives any one rank, so the rank that
notices a hang can tell which ranks are elsewhere: a peer that died, or one stuck outside the collective the others
wait in. Every live rank times out on its own and writes its own stack.
"""

import faulthandler
import json
import os
import sys
import threading
import time

from common.run import distributed, errors


class Watchdog:
    def __init__(self, timeout_s: float, output_dir: str):
        self.timeout_s, self.output_dir = timeout_s, output_dir
        self.rank, self.store = distributed.launch_rank, distributed.kv_store
        self.step, self.where, self.last = 0, "start", None  # `last`: when progress was last made (None: not yet)
        self.lock = threading.Lock()
        threading.Thread(target=self._watch, daemon=True).start()

    def progress(self, step: int, where: str, paused: bool = False) -> None:
        """The main thread got somewhere (`where`: a stage, or a gap after one); paused: not watched until the next
        progress (a wait for the other side of split placement, whose own watchdog watches its work)."""
        with self.lock:
            self.step, self.where, self.last = step, where, None if paused else time.monotonic()
        try:
            self.store.set(f"nanorl/progress/{self.rank}", json.dumps([step, where]))
        except Exception:  # noqa: BLE001 - the store is gone (the launcher died): the rank leaves by itself
            pass

    def _watch(self) -> None:
        while True:
            with self.lock:
                idle = None if self.last is None else time.monotonic() - self.last
            if idle is not None and idle > self.timeout_s:
                return self._report()
            time.sleep(max(0.05, min(1.0, self.timeout_s - (idle or 0.0))))

    def _report(self) -> None:
        step, where = self.step, self.where
        os.makedirs(os.path.join(self.output_dir, "hangs"), exist_ok=True)
        path = os.path.join(self.output_dir, "hangs", f"rank{self.rank}.txt")
        with open(path, "w") as f:
            f.write(f"rank {self.rank}: no progress for {self.timeout_s:g} s in {where} of step {step}\n")
            faulthandler.dump_traceback(file=f, all_threads=True)
        others = self._elsewhere(step, where)
        message = (f"error: hang: rank {self.rank} made no progress for {self.timeout_s:g} s (--hang-timeout) in "
                   f"{where} of step {step}; " + ("; ".join(others) if others else "every rank is at the same place "
                   "(a deadlock, or work that never returns)") + f"; Python stacks in {os.path.dirname(path)}/")
        if errors.first_to_report():
            print(message, file=sys.stderr, flush=True)
        errors.run_abort_hooks()
        sys.stdout.flush()
        os._exit(1)

    def _elsewhere(self, step: int, where: str) -> list[str]:
        """The ranks that are not where this one is, with where they are (as far as the store knows)."""
        try:
            world = distributed.launch_world
            keys = [f"nanorl/progress/{r}" for r in range(world)]
            found = {r: json.loads(self.store.get(k)) for r, k in enumerate(keys) if self.store.check([k])}
        except Exception:  # noqa: BLE001 - the store is gone: say what this rank knows
            return ["the other ranks cannot be asked (the launcher's store is gone)"]
        return [f"rank {r} " + (f"is in {found[r][1]} of step {found[r][0]}" if r in found else "never started")
                for r in range(world) if r != self.rank and found.get(r) != [step, where]]
