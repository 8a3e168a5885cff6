"""The checks of `bash tests/tools/gpu_checks.sh preempt` (issue 41): a run stopped or killed on purpose, then continued.
Each case prints one PASS/FAIL line with its evidence, from the launches' logs and exit codes in OUTDIR and the run
directory they shared.

  facts RUN_DIR                        after a stopped launch: its metrics rows and newest intact state, as JSON
                                       (OUTDIR/NAME_stopped.json), before the next launch redoes what follows them
  stop NAME RUN_DIR OUTDIR STEPS       SIGTERM to every process at a chosen moment (NAME_stopped), then the same
                                       command (NAME_resumed): the first exits 0 with a state of its last row's step
                                       (no update lost), the second resumes there and exits 0, every step's row once
  restart NAME RUN_DIR OUTDIR STEPS R  torchrun --max-restarts 1, one rank killed with SIGKILL (NAME): exit 0 after
                                       one restart, which resumed from state R (the newest), every step's row once
"""

import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repo root
from common.run.resume import latest_checkpoint, read_trainer_state  # noqa: E402


def facts(run_dir: str) -> dict:
    """Steps of every metrics row, of the training rows, and of the newest intact state (None: no state)."""
    path = os.path.join(run_dir, "metrics.jsonl")
    rows = [json.loads(line) for line in open(path)] if os.path.exists(path) else []
    state = latest_checkpoint(run_dir)
    return {"rows": [r["step"] for r in rows], "trained": [r["step"] for r in rows if "reward/mean" in r],
            "state": read_trainer_state(state)["step"] if state else None}


def launch(out: str, name: str) -> tuple[int | None, str]:
    """A launch's exit code (None: it never ran) and output."""
    rc, log = os.path.join(out, f"{name}.rc"), os.path.join(out, f"{name}.log")
    return (int(open(rc).read()) if os.path.exists(rc) else None), (open(log, errors="replace").read()
                                                                     if os.path.exists(log) else "")


def every_row_once(final: dict, steps: int) -> tuple[list[str], str]:
    """Problems with the finished run's rows, and their evidence."""
    problems = []
    duplicates = sorted({s for s in final["rows"] if final["rows"].count(s) > 1})
    if duplicates:
        problems.append(f"steps logged twice: {duplicates}")
    if final["trained"] != list(range(1, steps + 1)):
        problems.append(f"training rows {final['trained']}, not 1-{steps}")
    return problems, f"{len(final['rows'])} rows, training steps {compact(final['trained'])}, {len(duplicates)} twice"


def compact(steps: list[int]) -> str:
    return f"{steps[0]}-{steps[-1]}" if steps and steps == list(range(steps[0], steps[-1] + 1)) else str(steps)


def check_stop(name: str, run_dir: str, out: str, steps: int) -> tuple[list[str], str]:
    problems = []
    rc1, log1 = launch(out, f"{name}_stopped")
    rc2, log2 = launch(out, f"{name}_resumed")
    try:
        stopped = json.load(open(os.path.join(out, f"{name}_stopped.json")))
    except (OSError, json.JSONDecodeError):
        stopped = {"rows": [], "trained": [], "state": None}
    said = re.search(r"saved the training state at step (\d+)", log1)
    said = int(said.group(1)) if said else None
    if rc1 != 0:
        problems.append(f"the stopped launch exited {rc1}, not 0")
    if "finishing this step, then saving and stopping" not in log1:
        problems.append("no rank announced the stop signal")
    if said is None or not 1 <= said < steps:
        problems.append(f"the stopped launch said it saved at step {said}")
    if said != stopped["state"]:
        problems.append(f"it said it saved step {said}, and its newest state is {stopped['state']}")
    if stopped["state"] is None or not stopped["trained"] or stopped["state"] != stopped["trained"][-1]:
        problems.append(f"newest state {stopped['state']} is not the last row's step (an update lost)")
    if stopped["trained"] != list(range(1, (stopped["state"] or 0) + 1)):
        problems.append(f"rows before the relaunch {stopped['trained']}")
    resumed = re.search(r"resumed from \S+ at step (\d+)", log2)
    resumed = int(resumed.group(1)) if resumed else None
    if resumed != stopped["state"]:
        problems.append(f"the relaunch resumed at step {resumed}, not {stopped['state']}")
    if rc2 != 0:
        problems.append(f"the relaunch exited {rc2}, not 0")
    row_problems, rows = every_row_once(facts(run_dir), steps)
    evidence = (f"stopped launch rc={rc1}, saved at step {said}, rows {compact(stopped['trained'])}, newest state "
                f"{stopped['state']}; relaunch rc={rc2}, resumed at step {resumed}; {rows}")
    return problems + row_problems, evidence


def check_restart(name: str, run_dir: str, out: str, steps: int, resume_step: int) -> tuple[list[str], str]:
    problems = []
    rc, log = launch(out, name)
    # torchrun's report of the failed worker, e.g. "failed (exitcode: -9) local_rank: 0 (pid: 14717) of binary"
    killed = re.search(r"exitcode\W*-9\W*(local_rank\W*(\d+))?", log)
    before_kill = log[:killed.start()] if killed else log
    logged = [int(s) for s in re.findall(r"^step +(\d+) \|", before_kill, re.M)]  # rank 0's console rows
    starts = log.count("split placement:")  # rank 0 says it once per start: 2 after one restart
    resumed = [int(s) for s in re.findall(r"resumed from \S+ at step (\d+)", log)]
    if rc != 0:
        problems.append(f"exited {rc}, not 0")
    if not killed:
        problems.append("torchrun reported no worker killed by SIGKILL (exitcode -9)")
    elif killed.group(2) not in (None, "0"):
        problems.append(f"local rank {killed.group(2)} was the one killed, not trainer 0")
    if starts != 2:
        problems.append(f"{starts} start-ups, not 2 (one restart)")
    if resumed != [resume_step]:
        problems.append(f"resumed at steps {resumed}, not once at {resume_step}")
    row_problems, rows = every_row_once(facts(run_dir), steps)
    rank = killed.group(2) if killed and killed.group(2) else "?"
    evidence = (f"rc={rc}; rows on the console before the kill {compact(logged)}; "
                + (f"local rank {rank} killed (exitcode -9)" if killed else "no worker killed")
                + f"; {starts} start-ups; resumed at step {resumed} (newest state {resume_step}); {rows}")
    return problems + row_problems, evidence


def main():
    what = sys.argv[1]
    if what == "facts":
        print(json.dumps(facts(sys.argv[2])))
        return
    name, run_dir, out, steps = sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])
    if what == "stop":
        problems, evidence = check_stop(name, run_dir, out, steps)
    else:
        problems, evidence = check_restart(name, run_dir, out, steps, int(sys.argv[6]))
    print(f"{'PASS' if not problems else 'FAIL'} {name}: {evidence}" + "".join(f"\n  - {p}" for p in problems))


if __name__ == "__main__":
    main()
