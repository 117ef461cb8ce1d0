"""The suite's pytest sessions, forked from a warm interpreter instead of started cold.

Most end-to-end tests start ``python -m pytest`` through ``pytester``; each such interpreter
spent about 1.2 s of its 2 s importing torch, and they were half of the suite's time. Here
one interpreter per test process (``warm_server.py``) imports torch and pytest once, and each
session is a fork of it that runs ``python -m pytest`` as a fresh interpreter would: in the
test's folder, with its environment and import path, its streams on pytester's files, its
own exit, its SIGINT as the test process left it, an unseeded CPU generator. What the fork
cannot give is a fresh interpreter's first import of torch and its own hash seed: a test that
reads either is marked ``fresh_interpreter`` and runs cold. So does a session whose
environment changes a variable an interpreter or torch reads when it starts (``STARTUP``),
or whose import path holds a ``sitecustomize`` or shadows a module the server loaded.
``GPUCASE_TEST_COLD=1`` runs every session cold.
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import json
import os
import select
import signal
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
        self._modules: frozenset[str] | None = None
        self.dead = False

    def alive(self) -> bool:
        return not self.dead and self.process.poll() is None

    def modules(self) -> frozenset[str]:
        """The top-level modules the server holds (its first answer, once it is up)."""
        if self._modules is None:
            try:
                answer = self._answer(None)
            except BaseException:  # interrupted half way through a line: unreadable after
                self.close()
                raise
            assert answer is not None
            self._modules = frozenset(answer["modules"])
        return self._modules

    def shadowed(self, env: dict[str, str]) -> bool:
        """Whether a session's import path holds a ``sitecustomize``, a ``usercustomize`` or
        a module the server loaded already: a fresh interpreter would run or import it."""
        names = self.modules() | {"sitecustomize", "usercustomize"}
        # The folder is on PYTHONPATH too (``install`` puts it first): each listed once.
        folders = dict.fromkeys([os.getcwd(), *env.get("PYTHONPATH", "").split(os.pathsep)])
        for folder in filter(None, folders):
            try:
                entries = os.listdir(folder)
            except OSError:
                continue
            if any(_module_name(folder, entry) in names for entry in entries):
                return True
        return False

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
        self.modules()  # the server's first answer, read before any other
        pid = None
        try:
            self.stream.write(json.dumps(request).encode() + b"\n")
            started = self._answer(None)
            assert started is not None
            pid = started["pid"]
            answer = self._answer(timeout)
            if answer is None:
                os.kill(pid, signal.SIGKILL)
                answer = self._answer(None)
                assert answer is not None
                return None
            return os.waitstatus_to_exitcode(answer["status"])
        except BaseException:
            # Interrupted (a signal handler, pytest-timeout): its answers would be read as
            # the next session's. The session and this server end; the next gets a new one.
            if pid is not None:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            self.close()
            raise

    def close(self) -> None:
        if self.dead:
            return
        self.dead = True
        self.stream.close()
        self.sock.close()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def _module_name(folder: str, entry: str) -> str | None:
    """The top-level module ``entry`` of ``folder`` would be imported as, if it is one."""
    if entry.endswith((".py", *importlib.machinery.EXTENSION_SUFFIXES)):
        return entry.partition(".")[0]
    return entry if os.path.isdir(os.path.join(folder, entry)) else None


_server: _Server | None = None


def _get_server() -> _Server:
    global _server
    if _server is None or not _server.alive():
        _server = _Server()
    return _server


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
        if _COLD or args[:2] != [sys.executable, "-mpytest"] or stdin is not pytester.CLOSE_STDIN:
            return cold_run(*cmdargs, timeout=timeout, stdin=stdin)
        env = os.environ.copy()
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.getcwd(),
                                                         env.get("PYTHONPATH", "")]))
        server = _get_server()
        if (_startup(env) != _startup(server.env) or server.shadowed(env)
                or not server.lock.acquire(False)):
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
