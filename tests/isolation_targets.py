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
