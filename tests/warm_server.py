"""The warm interpreter behind ``tests/warm.py``: run by path, as ``python warm_server.py FD``.

It imports torch and pytest once, then forks one child per request read from the socket
FD; the child becomes ``python -m pytest ARGS`` run in the request's folder, environment
and import path, with its standard streams on the request's files, and ends as that
interpreter would (its ``SystemExit``, atexit handlers and all). The server first answers
the top-level modules it holds, then for each request the child's pid and its wait status.
Nothing of pytest_gpucase or of the suite is imported here: each session imports them
itself, as a fresh interpreter does.
"""

import contextlib
import json
import os
import runpy
import signal
import socket
import sys
from typing import Any

import pytest  # noqa: F401 - preloaded for the children
import torch

# A fresh interpreter's own path after its first entry (the script's folder here, the
# working folder for ``-m``): the standard library, site-packages and what .pth files add.
BASE_PATH = sys.path[1:]
# What a fresh interpreter started by the test process would have for SIGINT: Python's
# handler, or SIG_IGN where the suite was started with Ctrl-C ignored (``nohup``, ``&``).
INHERITED_SIGINT = signal.getsignal(signal.SIGINT)


def session(request: dict[str, Any]) -> None:
    """In the forked child: become ``python -m pytest`` for ``request``; never returns."""
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    stdin = os.open(os.devnull, os.O_RDONLY)
    out = os.open(request["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    err = os.open(request["err"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    for fd, target in ((stdin, 0), (out, 1), (err, 2)):
        os.dup2(fd, target)
        os.close(fd)
    extra = [entry for entry in request["env"].get("PYTHONPATH", "").split(os.pathsep) if entry]
    sys.path[:] = [request["cwd"], *extra, *BASE_PATH]
    sys.argv[:] = ["-m", *request["args"]]
    signal.signal(signal.SIGINT, INHERITED_SIGINT)
    torch.default_generator.seed()  # a fresh interpreter's CPU generator starts unseeded
    runpy.run_module("pytest", run_name="__main__", alter_sys=True)
    sys.exit(0)  # pytest's __main__ raises SystemExit; an exception ends us as it would


def serve(sock: socket.socket) -> None:
    stream = sock.makefile("rwb", buffering=0)
    # What is loaded already: a session that would shadow one of them runs cold.
    loaded = sorted({name.partition(".")[0] for name in sys.modules})
    stream.write(json.dumps({"modules": loaded}).encode() + b"\n")
    while True:
        line = stream.readline()
        if not line:
            return
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            stream.close()
            sock.close()
            session(request)
        stream.write(json.dumps({"pid": pid}).encode() + b"\n")
        _, status = os.waitpid(pid, 0)
        stream.write(json.dumps({"status": status}).encode() + b"\n")


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the test process's Ctrl-C is not ours
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # the test process went
        serve(socket.socket(fileno=int(sys.argv[1])))
