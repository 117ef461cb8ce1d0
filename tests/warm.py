"""The suite's pytest sessions, forked from a warm interpreter instead of started cold.

Most end-to-end tests start ``python -m pytest`` through ``pytester``; each such interpreter
spent about 1.2 s of its 2 s importing torch, and they were half of the suite's time. Here
one interpreter per test process (``warm_server.py``) imports torch and pytest once, and each
session is a fork of it that runs ``python -m pytest`` as a fresh interpreter would: in the
test's folder, with its environment and import path, its streams on pytester's files, its
own exit. What the fork cannot give is a fresh interpreter's first import of torch, and its
own hash seed; so a test that reads either, or that changes a variable an interpreter or
torch reads when it starts (``STARTUP``), runs cold, as does a test marked
``fresh_interpreter``. ``GPUCASE_TEST_COLD=1`` runs every session cold.
"""

from __future__ import annotations

import json
import os
import select
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

SERVER = Path(__file__).with_name("warm_server.py")
# Variables read when an interpreter starts, or by torch or its native libraries when torch
# is imported: a session whose environment differs from the server's in one runs cold.
STARTUP = ("PYTHON", "TORCH", "PYTORCH", "CUDA", "HIP", "ROCM", "OMP_", "KMP_", "GOMP_",
           "MKL", "OPENBLAS", "LD_", "MALLOC", "GLIBC")
_COLD = os.environ.get("GPUCASE_TEST_COLD") == "1"


def _startup(env: dict[str, str]) -> dict[str, str]:
    return {name: value for name, value in env.items()
            if name.startswith(STARTUP) and name != "PYTHONPATH"}


class _Server:
    """The warm interpreter of this test process, and the socket to it."""

    def __init__(self) -> None:
        mine, theirs = socket.socketpair()
        self.env = {name: value for name, value in os.environ.items() if name != "PYTHONPATH"}
        self.process = subprocess.Popen(
            [sys.executable, str(SERVER), str(theirs.fileno())], pass_fds=[theirs.fileno()],
            env=self.env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        theirs.close()
        self.sock = mine
        self.stream = mine.makefile("rwb", buffering=0)
        self.lock = threading.Lock()

    def alive(self) -> bool:
        return self.process.poll() is None

    def _answer(self, timeout: float | None) -> dict[str, Any] | None:
        if timeout is not None and not select.select([self.sock], [], [], timeout)[0]:
            return None
        line = self.stream.readline()
        if not line:
            raise RuntimeError("the warm interpreter of the test suite ended")
        answer: dict[str, Any] = json.loads(line)
        return answer

    def run(self, args: list[str], env: dict[str, str], out: Path, err: Path,
            timeout: float | None) -> int | None:
        """The session's exit code as ``Popen.wait`` gives it; None when it timed out (killed)."""
        request = {"args": args, "cwd": os.getcwd(), "env": env, "out": str(out),
                   "err": str(err)}
        self.stream.write(json.dumps(request).encode() + b"\n")
        started = self._answer(None)
        assert started is not None
        answer = self._answer(timeout)
        if answer is None:
            os.kill(started["pid"], 9)
            answer = self._answer(None)
            assert answer is not None
            return None
        return os.waitstatus_to_exitcode(answer["status"])

    def close(self) -> None:
        self.stream.close()
        self.sock.close()
        self.process.wait()


_server: _Server | None = None


def _get_server() -> _Server:
    global _server
    if _server is None or not _server.alive():
        _server = _Server()
    return _server


def start() -> None:
    """Start this process's warm interpreter now, so that it imports torch while tests run."""
    if not _COLD:
        _get_server()


def stop() -> None:
    global _server
    if _server is not None:
        _server.close()
        _server = None


def install(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    """Run ``pytester``'s ``python -m pytest`` sessions warm where they can be (module doc)."""
    cold_run = pytester.run

    def run(*cmdargs: str | os.PathLike[str], timeout: float | None = None,
            stdin: Any = pytester.CLOSE_STDIN) -> pytest.RunResult:
        args = [os.fspath(arg) for arg in cmdargs]
        if _COLD:
            return cold_run(*cmdargs, timeout=timeout, stdin=stdin)
        env = os.environ.copy()
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.getcwd(),
                                                         env.get("PYTHONPATH", "")]))
        server = _get_server()
        if (args[:2] != [sys.executable, "-mpytest"] or stdin is not pytester.CLOSE_STDIN
                or _startup(env) != _startup(server.env) or not server.lock.acquire(False)):
            return cold_run(*cmdargs, timeout=timeout, stdin=stdin)
        try:
            return _warm_run(pytester, server, args, env, timeout)
        finally:
            server.lock.release()

    monkeypatch.setattr(pytester, "run", run)


def _warm_run(pytester: pytest.Pytester, server: _Server, args: list[str],
              env: dict[str, str], timeout: float | None) -> pytest.RunResult:
    """``Pytester.run`` of ``args`` (``python -m pytest ...``), forked from ``server``."""
    __tracebackhide__ = True
    out, err = pytester.path / "stdout", pytester.path / "stderr"
    print("running (warm):", *args)
    print("     in:", Path.cwd())
    started = time.perf_counter()
    ret = server.run(args[2:], env, out, err, timeout)
    if ret is None:
        raise pytester.TimeoutExpired(f"{timeout} second timeout expired running: {args}")
    lines = out.read_text(encoding="utf8").splitlines()
    errors = err.read_text(encoding="utf8").splitlines()
    for line in lines:
        print(line)
    for line in errors:
        print(line, file=sys.stderr)
    try:
        code: int | pytest.ExitCode = pytest.ExitCode(ret)
    except ValueError:
        code = ret
    return pytest.RunResult(code, lines, errors, time.perf_counter() - started)
