"""The python tool's sandbox: model-written code runs under bubblewrap (`bwrap`, Debian's `bubblewrap` package).

What the code sees (docs/sandbox.md has the threat model): the interpreter, its standard library and the system's
shared libraries, read-only, with every site-packages hidden; a fresh tmpfs of SCRATCH_MB as /tmp (its cwd and
HOME); a /proc of its own PID namespace; no network (a new network namespace), no home, run directory, source tree
or socket file of the host. It runs as an unprivileged uid in new user, PID, IPC, UTS and mount namespaces with no
capabilities; when training runs as root the sandbox starts as the real uid `nobody` (the host's root files stay
closed to it even if a mount were escaped).

One call: bwrap's own init is PID 1 of the new PID namespace, the code is PID 2; when the code exits, or its time is
up and we kill PID 1, the kernel kills every process left in the namespace, so nothing outlives the call. Output is
read into a bounded buffer (OUTPUT_BYTES; the rest is counted, not kept). Where this user may make cgroups (v2, or
v1 memory and pids), all the call's processes share one memory and one process limit; elsewhere each process has
its own memory limit and the number of processes is capped per call (RLIMIT_NPROC, counted per user namespace).
"""

import functools
import glob
import json
import os
import resource
import select
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

TIME_S = 10.0  # wall-clock seconds a call may take (each process's CPU time too)
GRACE_S = 2.0  # past TIME_S, for the killed sandbox to go and its output to drain
MEMORY_MB = 1024  # all processes of a call together (a cgroup), else each process (RLIMIT_AS)
PROCESSES = 64  # processes and threads of a call at once
SCRATCH_MB = 64  # its writable /tmp, in memory (counted in MEMORY_MB where a cgroup holds the call)
OUTPUT_BYTES = 64 << 10  # of a call's output the caller keeps; the rest is only counted
NOBODY = 65534
INSTALL = "install the bubblewrap package (apt-get install bubblewrap)"

# Runs first in the sandbox: the process limit must be set inside the new user namespace (set outside, it would
# count every process of the user), then the code runs as __main__ with this frame left out of its tracebacks.
PRELUDE = ("import resource, sys\n"
           "resource.setrlimit(resource.RLIMIT_NPROC, ({processes}, {processes}))\n"
           "code = sys.argv.pop(1)\n"
           "sys.excepthook = lambda kind, error, tb: sys.__excepthook__(kind, error.with_traceback(tb.tb_next),\n"
           "                                                        tb.tb_next)\n"
           "exec(compile(code, '<string>', 'exec'), {{'__name__': '__main__', '__builtins__': __builtins__}})\n")


# ---------------------------------------------------------------------------------------------------------------
# What the sandbox sees

@functools.cache
def _visible() -> tuple[str, list[tuple[str, str]], list[str]]:
    """(the interpreter, [(kind, path)] to show read-only at the same path (kind "bind" or "symlink"), [package
    directories inside them to hide])."""
    interpreter = os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)
    shown = []
    for path in ["/usr/lib", "/usr/lib64", "/lib", "/lib64", "/lib32"]:  # libc, the loader, what modules link
        if os.path.islink(path):  # merged /usr: /lib -> usr/lib
            shown.append(("symlink", path))
        elif os.path.isdir(path):
            shown.append(("bind", path))
    stdlib = [p for p in sys.path if p and os.path.isdir(p) and Path(p).name not in ("site-packages", "dist-packages")
              and any(Path(p).is_relative_to(prefix) for prefix in {sys.base_prefix, sys.base_exec_prefix})]
    libdir = sysconfig.get_config_var("LIBDIR")  # libpython, when the interpreter links it
    for path in [libdir] * bool(libdir and os.path.isdir(libdir)) + stdlib + [interpreter]:
        if not any(kind == "bind" and Path(path).is_relative_to(p) for kind, p in shown):
            shown.append(("bind", path))
    hidden = sorted({d for kind, p in shown if kind == "bind" and os.path.isdir(p)
                     for pattern in ["site-packages", "dist-packages", "python3*/site-packages",
                                     "python3*/dist-packages", "python3/dist-packages"]
                     for d in glob.glob(os.path.join(p, pattern)) if os.path.isdir(d)})
    return interpreter, shown, hidden


@functools.cache
def _nobody_can_reach() -> bool:
    """Whether the uid nobody can reach what the sandbox shows (a Python under /root, mode 700, it cannot: then a
    root caller's sandbox keeps the kernel uid 0, mapped to nobody inside and without capabilities;
    docs/sandbox.md)."""
    interpreter, shown, _ = _visible()
    for kind, path in shown:
        for directory in [*Path(path).parents, Path(path)][::-1][1:] if kind == "bind" else []:
            if directory.is_dir() and not os.stat(directory).st_mode & 0o001:
                return False
    return True


@functools.cache
def _bwrap() -> str:
    path = shutil.which("bwrap") or next((p for p in ["/usr/bin/bwrap", "/bin/bwrap"] if os.access(p, os.X_OK)), None)
    if path is None:
        raise RuntimeError(f"the python tool needs bubblewrap (bwrap), not found: {INSTALL}")
    return path


def _command(code: str, processes: int, scratch_mb: int, info_fd: int) -> list:
    interpreter, shown, hidden = _visible()
    command = [_bwrap(), "--unshare-user", "--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts",
               "--unshare-cgroup-try", "--uid", str(NOBODY), "--gid", str(NOBODY), "--hostname", "sandbox",
               "--die-with-parent", "--new-session", "--cap-drop", "ALL", "--disable-userns"]
    for kind, path in shown:
        if kind == "symlink":
            command += ["--symlink", os.readlink(path), path]
        else:
            command += ["--ro-bind", path, path]
    for path in hidden:
        command += ["--tmpfs", path, "--remount-ro", path]
    command += ["--proc", "/proc", "--dev", "/dev", "--size", str(scratch_mb << 20), "--tmpfs", "/tmp",
                "--remount-ro", "/", "--remount-ro", "/dev", "--chdir", "/tmp", "--clearenv",
                "--setenv", "HOME", "/tmp", "--setenv", "TMPDIR", "/tmp", "--setenv", "LANG", "C.UTF-8",
                "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "PYTHONDONTWRITEBYTECODE", "1",
                "--info-fd", str(info_fd),
                interpreter, "-I", "-c", PRELUDE.format(processes=processes), code]
    return command


# ---------------------------------------------------------------------------------------------------------------
# Limits on the whole call: a cgroup where this user may make one

def _own_cgroups() -> dict[str, Path]:
    """controller ('memory', 'pids') -> this process's cgroup directory for it, where this user may write."""
    mounts = {}  # controller -> mount point ("" for cgroup2)
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        fstype, options = right.split()[0], right.split()[-1].split(",")
        mount = left.split()[4]
        if fstype == "cgroup2":
            mounts.setdefault("", mount)
        elif fstype == "cgroup":
            mounts.update({c: mount for c in ("memory", "pids") if c in options})
    found = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        for controller in controllers.split(",") if controllers else [""]:
            if controller in mounts:
                directory = Path(mounts[controller] + path)
                if controller == "":
                    enabled = (directory / "cgroup.subtree_control").read_text().split()
                    found.update({c: directory for c in ("memory", "pids") if c in enabled})
                else:
                    found.setdefault(controller, directory)
    return {c: d for c, d in found.items() if os.access(d, os.W_OK)}


@functools.cache
def _cgroup_parents() -> dict[str, Path]:
    try:
        parents = _own_cgroups()
    except (OSError, ValueError, IndexError):
        return {}
    for directory in set(parents.values()):  # left by a killed caller (whose supervisor did not clean them up)
        for stale in directory.glob("nanorl-sandbox-*"):
            if not Path(f"/proc/{stale.name.split('-')[2]}").exists():
                _empty_and_remove(stale)
    return parents


def kill_calls_of(pid: int) -> None:
    """After killing a caller (an environment worker past --env-timeout): its calls' processes, and their cgroups.
    bwrap's --die-with-parent reaches the sandbox's PID 1 only once bwrap has set it up: a caller killed as a call
    starts leaves that call running, for as long as it likes, unless its cgroup is emptied here."""
    for parent in set(_cgroup_parents().values()):
        for directory in parent.glob(f"nanorl-sandbox-{pid}-*"):
            _empty_and_remove(directory)


def _empty_and_remove(directory: Path) -> None:
    """Kills every process of a call's cgroup (again, while any is left: they may fork meanwhile) and removes it."""
    for _ in range(100):
        try:
            pids = (directory / "cgroup.procs").read_text().split()
        except OSError:  # removed already
            return
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except OSError:
                pass
        try:
            directory.rmdir()
            return
        except OSError:
            time.sleep(0.01)


def memory_cgroup_available() -> bool:
    """Whether a call's processes share one memory limit here (else the limit is per process)."""
    return "memory" in _cgroup_parents()


class _CallCgroup:
    """The cgroup(s) of one call: memory and process limits for all its processes together."""
    count = 0

    def __init__(self, memory_mb: int, processes: int):
        _CallCgroup.count += 1
        name = f"nanorl-sandbox-{os.getpid()}-{_CallCgroup.count}-{time.monotonic_ns()}"
        self.directories = []
        for directory in {d / name for d in _cgroup_parents().values()}:
            directory.mkdir()
            self.directories.append(directory)
        limits = {"memory.max": memory_mb << 20, "memory.swap.max": 0, "memory.limit_in_bytes": memory_mb << 20,
                  "memory.memsw.limit_in_bytes": memory_mb << 20, "pids.max": processes + 2}  # + bwrap, its init
        for directory in self.directories:
            for limit, value in limits.items():
                if (directory / limit).exists():
                    try:
                        (directory / limit).write_text(str(value))
                    except OSError:  # memsw without swap accounting
                        pass

    def enter(self) -> None:
        """In the child, before it drops its uid: moves it (and so all it starts) into the cgroups."""
        for directory in self.directories:
            fd = os.open(directory / "cgroup.procs", os.O_WRONLY)
            os.write(fd, b"0")
            os.close(fd)

    def remove(self) -> None:
        for directory in self.directories:
            _empty_and_remove(directory)  # (no process is left once bwrap has exited)


# ---------------------------------------------------------------------------------------------------------------
# One call

def _enter(cgroup: _CallCgroup | None, memory_mb: int, time_s: float, scratch_mb: int) -> None:
    """In the child, before bwrap starts: the call's cgroups, per-process limits, and as root the uid nobody."""
    if cgroup is not None:
        cgroup.enter()
    resource.setrlimit(resource.RLIMIT_AS, (memory_mb << 20, memory_mb << 20))
    resource.setrlimit(resource.RLIMIT_CPU, (int(time_s) + 1, int(time_s) + 1))
    resource.setrlimit(resource.RLIMIT_FSIZE, (scratch_mb << 20, scratch_mb << 20))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if os.geteuid() == 0 and _nobody_can_reach():
        os.setgroups([])
        os.setgid(NOBODY)
        os.setuid(NOBODY)


def _read_until(fd: int, deadline: float, kept: bytearray, total: int) -> tuple[int, bool]:
    """Reads fd until its end or the deadline, keeping at most OUTPUT_BYTES in `kept`: (bytes read in all, ended)."""
    while (left := deadline - time.monotonic()) > 0:
        if not select.select([fd], [], [], left)[0]:
            continue
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            return total, True
        total += len(chunk)
        kept += chunk[:max(0, OUTPUT_BYTES - len(kept))]
    return total, False


def _wait_gone(pid: int, deadline: float) -> None:
    """Waits for the sandbox's PID 1 to be gone. bwrap returns as soon as the code's process exits; PID 1 then
    dies with it (--die-with-parent), and the kernel kills the rest of the namespace before it reports PID 1 gone."""
    try:
        pidfd = os.pidfd_open(pid)
    except OSError:  # gone already
        return
    try:
        select.select([pidfd], [], [], max(0.0, deadline - time.monotonic()))
    finally:
        os.close(pidfd)


def run_in_sandbox(code: str, time_s: float = TIME_S, memory_mb: int = MEMORY_MB, processes: int = PROCESSES,
                   scratch_mb: int = SCRATCH_MB) -> tuple[int | None, bytes, int]:
    """Runs `code` in the sandbox. Returns (its exit status, None when it ran past time_s and was killed, 126 when
    the sandbox could not start; the first OUTPUT_BYTES of its stdout and stderr; how many bytes they had in all)."""
    info_read, info_write = os.pipe()
    cgroup = _CallCgroup(memory_mb, processes) if _cgroup_parents() else None
    try:
        process = subprocess.Popen(
            _command(code, processes, scratch_mb, info_write), stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={}, cwd="/",
            pass_fds=[info_write], preexec_fn=lambda: _enter(cgroup, memory_mb, time_s, scratch_mb))
        os.close(info_write)
        info_write = None
        kept, fd, info = bytearray(), process.stdout.fileno(), {}
        total, ended = _read_until(fd, time.monotonic() + time_s, kept, 0)
        if not ended:  # time is up: PID 1 of the sandbox takes every process of it along
            info = json.loads(os.read(info_read, 4096) or b"{}") if select.select([info_read], [], [], GRACE_S)[0] \
                else {}
            if "child-pid" in info and process.poll() is None:
                os.kill(info["child-pid"], signal.SIGKILL)
            total, _ = _read_until(fd, time.monotonic() + GRACE_S, kept, total)
        try:
            status = process.wait(timeout=GRACE_S)
        except subprocess.TimeoutExpired:
            process.kill()
            status = process.wait()
        process.stdout.close()
        if ended and select.select([info_read], [], [], 0)[0]:  # bwrap wrote it before starting the code
            info = json.loads(os.read(info_read, 4096) or b"{}")
        if "child-pid" in info:
            _wait_gone(info["child-pid"], time.monotonic() + GRACE_S)
        if not ended:
            return None, bytes(kept), total
        if "child-pid" not in info:  # bwrap failed before the code ran: its message is the output
            return 126, b"sandbox: " + bytes(kept), total
        return status, bytes(kept), total
    finally:
        for descriptor in [info_read] + [info_write] * (info_write is not None):
            os.close(descriptor)
        if cgroup is not None:
            cgroup.remove()
