"""Reusable workers (``--gpu-isolation case`` and ``worker``): children that run call after call.

Two processes run this module. The parent (the pytest process) keeps the pools, sends each
call over the worker's socket with the call's own pipes, and supervises it as it does a
fresh child (``supervise``). The worker, a forked or zygote-forked child, runs the calls one
at a time (``_worker_serve``). After each call's result it settles its state against the
state it had before its first call, when it was a fresh child (``state.WorkerState``), and
tells the parent on the socket whether it may take the next call: ``ok``, or why it ends.
The parent reads that answer before it sends the next call, so that the settling overlaps
the parent's own work on the result instead of delaying it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import pickle
import secrets
import select
import socket
import time
from collections.abc import Callable, Mapping
from typing import Any

from pytest_gpucase.run.isolation.child import (
    _envelope_noting,
    _flush_std_streams,
    _save_coverage,
    _write_all,
    fork_child,
)
from pytest_gpucase.run.isolation.hugepages import before_fork
from pytest_gpucase.run.isolation.proctree import (
    MARKER_ENV,
    REAP_GRACE,
    adopt_orphans,
    now_ticks,
)
from pytest_gpucase.run.isolation.result import ChildResult, StartMethod
from pytest_gpucase.run.isolation.state import WorkerState, prime
from pytest_gpucase.run.isolation.supervise import (
    _PENDING,
    _Interruptible,
    _Run,
    _Supervisor,
    reap_pending,
)
from pytest_gpucase.run.isolation.zygote import _receive_exactly, _Zygote, forkserver

__all__ = ["STATUS_LIMIT", "WorkerPool", "close_pools"]

# Every pool of the session, for ``close_pools`` (``shutdown``).
_POOLS: list[WorkerPool] = []
STATUS_LIMIT = 64 * 1024  # bytes of a worker's answer after a call: why it ends, if it does
_RETIRED_KEPT = 100  # retirements a pool remembers (``WorkerPool.retired``)


class WorkerPool:
    """Long-lived children that run calls one after another, by key (device, environment,
    and the case in ``case`` isolation), to amortize a device context over many runs.

    A worker ends on anything it cannot vouch for: a crash, a timeout, a result refused,
    a process left behind, or, found after the call, any state a fresh child would not
    have (``state.WorkerState``: the reasons are kept in ``retired``); the caller retires
    it after a failure too (``retire``). Each result says whether it came from a worker
    that had run an earlier call (``ChildResult.reused``): a worker's first call is a
    fresh child's. ``shutdown`` ends every pool's workers.
    """

    def __init__(self) -> None:
        self.workers: dict[Any, _Worker] = {}
        # (key, why, the label of the call that left it so), the latest last
        self.retired: list[tuple[Any, tuple[str, ...], str]] = []
        self.unread = 0  # retirements at the end of ``retired`` not yet taken (``take_retired``)
        _POOLS.append(self)
        prime()

    def run(self, key: Any, func: Callable[..., Any], *args: Any, timeout: float,
            env: Mapping[str, str] | None = None, start_method: StartMethod = "fork",
            memory_limit: int | None = None, exclusive: bool = False,
            marks: Mapping[str, str] | None = None, label: str = "") -> ChildResult:
        """``func(*args)`` in the worker of ``key`` (started now if there is none, or if the
        one there ended after its last call); with ``exclusive``, the other workers end first
        (one case's worker at a time). ``marks`` as ``run_in_child`` has them; ``label``
        names the call where a retirement it causes is told."""
        if exclusive:
            for other in [k for k in self.workers if k != key]:
                self.retire(other)
        worker = self.workers.get(key)
        if worker is not None:
            reasons = worker.settled()
            if reasons:
                self.retired.append((key, reasons, worker.label))
                del self.retired[:-_RETIRED_KEPT]
                self.unread = min(self.unread + 1, len(self.retired))
                self.retire(key)
                worker = None
        if worker is None:
            worker = self.workers[key] = _Worker(start_method, env or {})
        worker.label = label
        result = worker.call(func, args, timeout, memory_limit, marks)
        if not worker.usable:
            del self.workers[key]
        return result

    def take_retired(self) -> list[tuple[str, tuple[str, ...]]]:
        """The retirements for state left behind since the last take: (label, why)."""
        taken = self.retired[len(self.retired) - self.unread:] if self.unread else []
        self.unread = 0
        return [(label, why) for _, why, label in taken]

    def retire(self, key: Any) -> None:
        """End the worker of ``key``, if there is one."""
        worker = self.workers.pop(key, None)
        if worker is not None:
            worker.close()

    def close(self) -> None:
        for key in list(self.workers):
            self.retire(key)
        reap_pending()


def close_pools() -> None:
    """End every pool's workers (the end of the session)."""
    for pool in list(_POOLS):
        pool.close()


class _Worker:
    """One reusable child and this process's socket to it."""

    def __init__(self, start_method: StartMethod, env: Mapping[str, str]) -> None:
        if start_method == "spawn":
            raise ValueError("a reusable worker is forked (fork or forkserver), not spawned")
        self.token = secrets.token_hex(16)
        self.start_method = start_method
        self.calls = 0
        self.label = ""  # the current call's (``WorkerPool.run``)
        child_env = {**env, MARKER_ENV: self.token}
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        nulls = (os.open(os.devnull, os.O_WRONLY), os.open(os.devnull, os.O_WRONLY))
        self.zygote: _Zygote | None = None
        reap_pending(block=False)
        try:
            if start_method == "forkserver":
                self.zygote = forkserver()
                self.pid = self.zygote.start(_worker_serve, (), (*nulls, theirs.fileno()),
                                             child_env, fd_argument=True)
            else:
                adopt_orphans()
                before_fork()
                pid = fork_child(nulls[0], nulls[1], theirs.fileno(), (mine.fileno(),),
                                 child_env, _worker_serve, (theirs.fileno(),), name="worker")
                self.pid = pid
                with contextlib.suppress(OSError):
                    os.setpgid(pid, pid)
        finally:
            theirs.close()
            for fd in nulls:
                os.close(fd)
        self.sock = mine
        self.usable = True

    def settled(self) -> tuple[str, ...]:
        """Wait for the worker's answer after its last call: () when it may take the next
        one, else why it ends (it exits on its own; or it is past ``REAP_GRACE``)."""
        if self.zygote is not None and self.zygote.ended:
            # Its answer after the last call may be there, written before it died with the
            # zygote (its death signal): not read.
            return ("its zygote was ended (it stopped answering), and the worker with it",)
        if self.calls == 0:
            return ()
        data = bytearray()
        end = time.monotonic() + REAP_GRACE
        poller = select.poll()
        poller.register(self.sock.fileno(), select.POLLIN)
        while not data.endswith(b"\n") and len(data) < STATUS_LIMIT:
            left = end - time.monotonic()
            if left <= 0 or not poller.poll(left * 1000):
                return (f"it did not settle within {REAP_GRACE:g} s after its last call",)
            try:
                chunk = self.sock.recv(STATUS_LIMIT - len(data))
            except OSError:
                chunk = b""
            if not chunk:
                return ("it ended after its last call",)
            data += chunk
        if data == b"ok\n":
            return ()
        return _reasons(bytes(data))

    def call(self, func: Callable[..., Any], args: tuple[Any, ...], timeout: float,
             memory_limit: int | None, marks: Mapping[str, str] | None = None) -> ChildResult:
        if not timeout >= 0:
            raise ValueError(f"timeout must be a number of seconds >= 0, not {timeout!r}")
        reused, self.calls = self.calls > 0, self.calls + 1
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        res_r, res_w = os.pipe()
        start = time.monotonic()
        since = now_ticks()  # what the worker starts from now on is this call's
        try:
            with _Interruptible() as guard:
                job = pickle.dumps((func, args))  # the parent's own data, as for spawn
                blob = len(job).to_bytes(8, "little") + job
                try:
                    sent = socket.send_fds(self.sock, [blob], [out_w, err_w, res_w])
                    self.sock.sendall(blob[sent:])
                except OSError:  # it died between calls: the result will say so
                    pass
                for fd in (out_w, err_w, res_w):
                    os.close(fd)
                out_w = err_w = res_w = -1
                run = _Run(self.pid, self.token, memory_limit, zygote=self.zygote, reusable=True,
                           started=since)
                result = _Supervisor(run, out_r, err_r, res_r, timeout, start,
                                     self.start_method, marks).watch(guard)
        finally:
            for fd in (out_r, err_r, res_r, out_w, err_w, res_w):
                if fd >= 0:
                    os.close(fd)
        if not run.kept:  # killed and reaped, or exiting and pending
            self.usable = False
            self.sock.close()
        return dataclasses.replace(result, reused=reused)

    def close(self) -> None:
        """End the worker: it exits when its socket closes (killed if it does not)."""
        if not self.usable:
            return
        self.usable = False
        self.sock.close()
        _PENDING.append(_Run(self.pid, self.token, None, zygote=self.zygote))


def _reasons(data: bytes) -> tuple[str, ...]:
    """Why a worker ends, from its answer (the worker runs a case's code: checked, bounded)."""
    try:
        found = json.loads(data.decode("utf-8", "replace").removeprefix("retire "))
    except ValueError:
        found = None
    if not isinstance(found, list) or not all(isinstance(item, str) for item in found):
        return (f"it answered {data[:200]!r} after its last call",)
    return tuple(item[:500] for item in found[:20]) or ("it asked to end",)


# --- in the worker ---------------------------------------------------------------------------

def _worker_serve(sock_fd: int) -> None:  # pragma: no cover - the worker
    """Run the calls the parent sends, one at a time, each with its own pipes; after each,
    settle the state and answer whether the worker takes the next call."""
    sock = socket.socket(fileno=sock_fd)
    null = os.open(os.devnull, os.O_RDWR)
    state = WorkerState()  # as a fresh child is: the state every call starts from
    while True:
        data, fds, _, _ = socket.recv_fds(sock, 1 << 16, 3)
        if len(data) < 8 or len(fds) != 3:
            _end_worker()
        size = int.from_bytes(data[:8], "little")
        job = _receive_exactly(sock, size + 8, data)[8:]
        out_w, err_w, res_w = fds
        _flush_std_streams()
        os.dup2(out_w, 1)
        os.dup2(err_w, 2)
        os.close(out_w)
        os.close(err_w)
        payload = _envelope_noting(res_w, _unpickle_and_call, (job,), _keep)
        _flush_std_streams()
        try:
            _write_all(res_w, payload)
        except BaseException:
            _end_worker()
        os.dup2(null, 1)
        os.dup2(null, 2)
        os.close(res_w)
        # The result is out: the parent reports it while this settles (read before the
        # next call is sent).
        reasons = state.settle()
        try:
            sock.sendall(b"ok\n" if not reasons else
                         b"retire " + json.dumps(reasons).encode() + b"\n")
        except BaseException:
            _end_worker()
        if reasons:
            _end_worker()


def _end_worker() -> None:  # pragma: no cover - the worker
    _flush_std_streams()
    _save_coverage()
    os._exit(0)


def _keep() -> dict[str, Any]:  # pragma: no cover - the worker
    """The result's flag: the worker is left running after the call (``supervise``)."""
    return {"retire": False}


def _unpickle_and_call(job: bytes) -> Any:  # pragma: no cover - the worker
    func, args = pickle.loads(job)  # the parent's own data
    return func(*args)
