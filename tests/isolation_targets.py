"""Functions the isolation tests run in children (importable, so spawn can find them)."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator


REACHED = "reached the target"


def reach(target: Callable[..., object], *args: object) -> object:
    """Note that the child got as far as ``target``, then call it (``helpers.run_reaching``)."""
    from pytest_gpucase.run.isolation import note

    note(REACHED)
    return target(*args)


def stack_signal_blocked() -> dict[str, bool]:
    """Whether SIGUSR1 (the stack-dump signal) is blocked in this child, and in a process it
    starts: a case's code and what it starts must never inherit the start's hold."""
    import subprocess

    probe = ("import signal; "
             "print(signal.SIGUSR1 in signal.pthread_sigmask(signal.SIG_BLOCK, ()))")
    started = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                             check=True).stdout.strip()
    return {"child": signal.SIGUSR1 in signal.pthread_sigmask(signal.SIG_BLOCK, ()),
            "started": started == "True"}


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


# --- state a call leaves behind in a reused worker --------------------------------------------

def _leak_thread() -> None:
    import threading

    threading.Thread(target=time.sleep, args=(600,), name="left-behind", daemon=True).start()


def _leak_function_mode() -> None:
    from torch.overrides import TorchFunctionMode

    TorchFunctionMode().__enter__()  # never left


def _leak_linear_forward() -> None:
    import torch

    torch.nn.Linear.forward = lambda self, x: x  # type: ignore[method-assign]


def _leak_aten_kernel() -> None:
    import torch

    library = torch.library.Library("aten", "IMPL")
    library.impl("exp", lambda t: torch.zeros_like(t), "CPU")
    torch._kept_library = library  # type: ignore[attr-defined] # its kernel lives while it does


def _leak_helper_global() -> None:
    from tests import leak_helper

    leak_helper.VALUE = 2


def _leak_helper_config() -> None:
    from tests import leak_helper

    leak_helper.CONFIG["scale"] = 0.0


def _leak_helper_data(statement: str) -> Callable[[], None]:
    def leak() -> None:
        from tests import leak_helper

        exec(statement, {"leak_helper": leak_helper, "torch": __import__("torch")})
    return leak


def _leak(statement: str) -> Callable[[], None]:
    def leak() -> None:
        import torch  # noqa: F401 - the statements below use it

        exec(statement)
    return leak


# kind -> (what leaves the state, a word the worker's reason for ending holds)
LEAKS: dict[str, tuple[Callable[[], None], str]] = {
    "torch.exp replaced": (_leak("torch.exp = lambda x, *a, **k: torch.zeros_like(x)"),
                           "torch.exp"),
    "an attribute set on torch": (_leak("torch.POISON = True"), "torch.POISON"),
    "a torch.nn layer patched": (_leak_linear_forward, "Linear.forward"),
    "an optimizer patched": (_leak("torch.optim.SGD.step = lambda self, closure=None: None"),
                             "SGD.step"),
    "an aten kernel overridden": (_leak_aten_kernel, "torch.library"),
    "a shared helper's global": (_leak_helper_global, "leak_helper.VALUE"),
    "a shared helper's dict changed in place": (_leak_helper_config, "leak_helper.CONFIG"),
    "a shared helper's tensor changed in place": (_leak_helper_data("leak_helper.TABLE.mul_(0)"),
                                                  "leak_helper.TABLE"),
    "a shared helper's layer trained": (_leak_helper_data(
        "with torch.no_grad(): leak_helper.LAYER.weight.zero_()"), "leak_helper.LAYER"),
    "a shared helper's layer put in eval mode": (_leak_helper_data("leak_helper.LAYER.eval()"),
                                                 "leak_helper.LAYER.training"),
    "a shared helper's settings object": (_leak_helper_data("leak_helper.SETTINGS.scale = 0.0"),
                                          "leak_helper.SETTINGS.scale"),
    "a shared helper's nested dict": (_leak_helper_data("leak_helper.NESTED['opts']['scale'] = 0"),
                                      "leak_helper.NESTED"),
    "a shared helper's nested tensor": (_leak_helper_data(
        "leak_helper.NESTED['tables'][0].mul_(0)"), "leak_helper.NESTED"),
    "gpucase's tolerance table": (_leak(
        "from pytest_gpucase.verdict import tolerance as t; "
        "t.DEFAULT_TOLERANCES[torch.float32] = t.Tolerance(rtol=1.0, atol=1.0)"),
        "DEFAULT_TOLERANCES"),
    "gpucase's comparison patched": (_leak(
        "from pytest_gpucase.verdict.compare import Comparison; "
        "Comparison.ok = property(lambda self: True)"), "Comparison.ok"),
    "builtins patched": (_leak("import builtins; builtins.sum = min"), "builtins.sum"),
    "math patched": (_leak("import math; math.exp = math.sqrt"), "math.exp"),
    "flush-denormal": (_leak("torch.set_flush_denormal(True)"), "flush_denormal"),
    "anomaly mode": (_leak("torch.autograd.set_detect_anomaly(True)"), "anomaly"),
    "default device": (_leak("torch.set_default_device('meta')"), "set_default_device"),
    "a torch function mode left on": (_leak_function_mode, "torch mode"),
    "warn always": (_leak("torch.set_warn_always(True)"), "warnAlways"),
    "interop threads": (_leak("torch.set_num_interop_threads(3)"), "interop"),
    "a thread left running": (_leak_thread, "thread"),
    "an environment variable": (_leak("import os; os.environ['GPUCASE_LEAK'] = '1'"),
                                "GPUCASE_LEAK"),
    "os.putenv": (_leak("import os; os.putenv('GPUCASE_LEAK', '1')"), "environment"),
    "a signal handler": (_leak("import signal; signal.signal(signal.SIGUSR2, lambda *a: None)"),
                         "signal handlers"),
    "a pending alarm": (_leak("import signal; signal.signal(signal.SIGALRM, signal.SIG_IGN); "
                              "signal.alarm(600)"), "timer"),
    "the recursion limit": (_leak("import sys; sys.setrecursionlimit(123456)"), "recursion"),
    "an import hook": (_leak("import sys; sys.meta_path.insert(0, object())"), "import hook"),
    "sys.stdout closed": (_leak("import sys; sys.stdout.close()"), "sys.stdout"),
    "sys.stdout reconfigured": (_leak("import sys; sys.stdout.reconfigure(encoding='ascii')"),
                                "sys.stdout"),
    "a module replaced in sys.modules": (_leak("import sys, types; "
                                               "sys.modules['json'] = types.ModuleType('json')"),
                                         "json"),
}


def leave(kind: str) -> int:
    """Leave the state of ``kind`` behind, and say which process did."""
    LEAKS[kind][0]()
    return os.getpid()


# Restored between calls, not a reason to end the worker: -> a probe of the fresh value.
RESTORED: dict[str, tuple[str, str]] = {
    "default dtype": ("torch.set_default_dtype(torch.float64)", "str(torch.get_default_dtype())"),
    "grad mode": ("torch.set_grad_enabled(False)", "torch.is_grad_enabled()"),
    "thread count": ("torch.set_num_threads(1 + torch.get_num_threads())",
                     "torch.get_num_threads()"),
    "torch's random state": ("torch.manual_seed(1234)", "torch.rand(1).item()"),
    "the working directory": ("import os; os.chdir('/')", "__import__('os').getcwd()"),
    "deterministic algorithms": ("torch._C._set_deterministic_algorithms(True, warn_only=True)",
                                 "torch.are_deterministic_algorithms_enabled()"),
}


def change_restored(kind: str) -> int:
    exec(RESTORED[kind][0], {"torch": __import__("torch")})
    return os.getpid()


def probe_restored(kind: str) -> tuple[int, object]:
    return os.getpid(), eval(RESTORED[kind][1], {"torch": __import__("torch")})


def import_helper_from(folder: str, value: int) -> int:
    """Import a helper module first imported by this call, and change its global."""
    sys.path.insert(0, folder)
    import new_helper  # type: ignore[import-not-found]

    new_helper.VALUE = value
    return os.getpid()


def helper_value(folder: str) -> tuple[int, int]:
    sys.path.insert(0, folder)
    import new_helper  # type: ignore[import-not-found]

    return os.getpid(), new_helper.VALUE


def streams() -> list[object]:
    """Line-buffered text on fds 1 and 2, with their fds and what a write of text that is not
    ASCII gives (nothing left buffered when the child ends on a crash)."""
    print("déjà vu")
    sys.stderr.write("naïve\n")
    found = [sys.stdout.fileno(), sys.stderr.fileno(), sys.stdout.line_buffering,
             sys.stderr.line_buffering, sys.stdout.errors]
    os.write(1, b"after\n")  # in order: the line above was written, not kept in a buffer
    return found


def partial_then_abort(chunk: int, count: int) -> None:
    """Text without a newline, in ``count`` writes of ``chunk`` characters, then a crash."""
    for _ in range(count):
        sys.stdout.write("x" * chunk)
    os.abort()


def stream_attributes() -> list[object]:
    """What a file opened on fds 1 and 2 tells of itself: its name and mode, and its repr."""
    raw: object = sys.stdout.buffer
    return [sys.stdout.name, sys.stdout.mode, sys.stderr.name, sys.stderr.mode,
            raw.raw.name, repr(sys.stdout)]  # type: ignore[attr-defined]


def stdout_encoding() -> str:
    return sys.stdout.encoding


def print_while_os_write_is_patched() -> list[int]:
    """A print while the case has ``os.write`` replaced (a test double counting its writes):
    the fds that the replacement was called with."""
    calls: list[int] = []
    real = os.write

    def counting(fd: int, data: bytes) -> int:
        calls.append(fd)
        return len(data)

    os.write = counting
    try:
        print("printed")
    finally:
        os.write = real
    return calls


def pid_and_hang(pid_file: str) -> None:
    """Say its pid, then hang."""
    _write_pid(pid_file, os.getpid())
    time.sleep(600)


# What ``marking_prepare`` left in the process that forks, for its child to inherit.
PREPARED: dict[str, object] = {}


@contextlib.contextmanager
def marking_prepare(value: str, fail: bool = False) -> Iterator[None]:
    """A ``run_in_child`` prepare: marks the process it is entered in, until its block ends."""
    if fail:
        raise RuntimeError("this prepare fails")
    PREPARED.update(value=value, where=os.getpid())
    try:
        yield
    finally:
        PREPARED.clear()


def prepared_here() -> tuple[object, object, int]:
    """What the child inherited of ``marking_prepare``, and its parent's pid."""
    return PREPARED.get("value"), PREPARED.get("where"), os.getppid()


def process_context(name: str) -> tuple[str | None, str, str]:
    """The variable ``name``, the first import path and the folder this child runs in."""
    return os.environ.get(name), sys.path[0], os.getcwd()


def expected_forks() -> tuple[int, bool] | None:
    """What the process that forked this child expects of its forks (its huge pages'
    state, inherited), and whether its huge pages are off; None when it has none."""
    from pytest_gpucase.run.isolation import hugepages

    state = hugepages._STATE
    return None if state is None else (state.expected, state.off)


@contextlib.contextmanager
def slow_prepare(seconds: float) -> Iterator[None]:
    """A ``run_in_child`` prepare that takes ``seconds`` (no part of the run's time)."""
    time.sleep(seconds)
    yield


@contextlib.contextmanager
def interrupted_prepare() -> Iterator[None]:
    """A prepare met by Ctrl-C."""
    raise KeyboardInterrupt
    yield  # pragma: no cover


def nothing() -> None:
    """A run that does nothing."""
