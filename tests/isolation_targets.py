"""Functions the isolation tests run in children (importable, so spawn can find them)."""

from __future__ import annotations

import os
import signal
import sys
import time


def echo(x: int) -> int:
    print("to stdout")
    os.write(2, b"to fd 2\n")
    return x * 2


def read_env(name: str) -> str | None:
    return os.environ.get(name)


def segfault() -> None:
    os.kill(os.getpid(), signal.SIGSEGV)


def abort() -> None:
    os.abort()


def exit_now(code: int) -> None:
    sys.stdout.flush()
    os._exit(code)


def raise_value_error() -> None:
    raise ValueError("boom")


def unpicklable() -> object:
    return lambda: None


def hang() -> None:
    time.sleep(600)


def fork_grandchild_and_hang(pid_file: str) -> None:
    pid = os.fork()
    if pid == 0:
        time.sleep(600)
        os._exit(0)
    with open(pid_file, "w") as handle:
        handle.write(str(pid))
    time.sleep(600)


def ignore_sigterm_and_hang() -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    time.sleep(600)


def flood(nbytes: int) -> int:
    sys.stdout.write("BEGIN\n")
    line = "x" * 1023 + "\n"
    for _ in range(nbytes // 1024):
        sys.stdout.write(line)
    sys.stdout.write("END\n")
    return nbytes


# --- containment: processes that try to escape, results that try to attack --------------------

def _write_pid(path: str, pid: int) -> None:
    with open(path + ".tmp", "w") as handle:
        handle.write(str(pid))
    os.replace(path + ".tmp", path)  # whole or absent: the test polls for it


def join_parent_group_and_hang(pid_file: str) -> None:
    """Leave the run's process group for the pytest process's own."""
    os.setpgid(0, os.getpgid(os.getppid()))
    _write_pid(pid_file, os.getpid())
    time.sleep(600)


def setsid_grandchild_and_hang(pid_file: str) -> None:
    """Start a grandchild in a session of its own."""
    pid = os.fork()
    if pid == 0:
        os.setsid()
        _write_pid(pid_file, os.getpid())
        time.sleep(600)
        os._exit(0)
    time.sleep(600)


def _daemon(pid_file: str) -> None:
    """Double-fork a grandchild out of the session, as a daemon does; the middle one exits."""
    middle = os.fork()
    if middle == 0:
        os.setsid()
        if os.fork() == 0:
            _write_pid(pid_file, os.getpid())
            time.sleep(600)
        os._exit(0)
    os.waitpid(middle, 0)


def daemon_and_hang(pid_file: str) -> None:
    _daemon(pid_file)
    time.sleep(600)


def daemon_and_return(pid_file: str) -> int:
    _daemon(pid_file)
    while not os.path.exists(pid_file):
        time.sleep(0.01)
    return 7


def big_list(nbytes: int) -> list[str]:
    """About ``nbytes`` of result (one long string would be cut to its head and tail)."""
    return ["x" * 1024] * (nbytes // 1024)


class Marker:
    """A pickle that would leave a file behind if anything ever unpickled it."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[object, tuple[str, str]]:
        return (open, (self.path, "w"))


def send_raw_result(data: bytes) -> None:
    """Write ``data`` as the result, around the child's own protocol, and exit."""
    import inspect

    frame = inspect.currentframe()
    while frame is not None and "res_w" not in frame.f_locals:
        frame = frame.f_back  # up to _child_main (or a worker's loop), which holds the pipe
    assert frame is not None
    fd = frame.f_locals["res_w"]
    os.write(fd, data)
    os._exit(0)


def nested_value() -> object:
    return {"a": (1.5, float("nan"), float("inf"), -float("inf")), 3: [None, True, "s"],
            (1, 2): {"deep": ()}}


def warn_often() -> int:
    import warnings

    for _ in range(500):
        warnings.warn("std(): degrees of freedom is <= 0", UserWarning, stacklevel=1)
    warnings.warn("overflow encountered", RuntimeWarning, stacklevel=1)
    for number in range(100):
        warnings.warn(f"distinct {number}", DeprecationWarning, stacklevel=1)
    return 1


def hold_memory(nbytes: int) -> int:
    block = bytearray(b"\x01") * nbytes  # written, so resident
    time.sleep(60)
    return len(block)


def raise_message(text: str) -> None:
    raise ValueError(text)


def daemon_and_die(pid_file: str) -> None:
    """Fork a daemon (its own session, no exec) that outlives this child, which then dies
    without a result: the daemon is an orphan nobody in the run's tree holds any more."""
    _daemon(pid_file)
    while not os.path.exists(pid_file):
        time.sleep(0.01)
    os._exit(3)


def capped_fork_bomb(cap: int, pid_file: str) -> None:
    """A fork bomb that never has more than ``cap`` processes: each forks while a counter
    shared by all of them (a page of shared memory, under a lock) is below ``cap``; past
    it, each keeps forking a child that exits at once, so that every process spends its
    time inside ``fork()``. Every pid is appended to ``pid_file``. ``RLIMIT_NPROC`` caps it
    too where it applies (not to root)."""
    import fcntl
    import mmap
    import resource

    if os.geteuid() != 0:
        with open("/proc/loadavg") as handle:  # running/total ... : total is field 4
            total = int(handle.read().split()[3].split("/")[1])
        resource.setrlimit(resource.RLIMIT_NPROC, (total + 2 * cap, total + 2 * cap))
    counter = mmap.mmap(-1, 8)  # shared with every fork
    lock = os.open(pid_file + ".lock", os.O_RDWR | os.O_CREAT, 0o600)
    log = os.open(pid_file, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)

    def claim() -> bool:
        fcntl.lockf(lock, fcntl.LOCK_EX)  # per process: every fork takes it in turn
        try:
            count = int.from_bytes(counter[:8], "little")
            if count >= cap:
                return False
            counter[:8] = (count + 1).to_bytes(8, "little")
            return True
        finally:
            fcntl.lockf(lock, fcntl.LOCK_UN)

    os.write(log, f"{os.getpid()}\n".encode())
    while True:
        grow = claim()
        try:
            pid = os.fork()
        except OSError:
            continue
        if pid == 0:
            if not grow:
                os._exit(0)
            os.write(log, f"{os.getpid()}\n".encode())
            continue  # a new member of the bomb: it forks too
        if not grow:
            os.waitpid(pid, 0)

