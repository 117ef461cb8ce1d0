"""Reusable workers (``--gpu-isolation case`` and ``worker``): children that run call after call.

Two processes run this module. The parent (the pytest process) keeps the pools, sends each
call over the worker's socket with the call's own pipes, and supervises it as it does a
fresh child (``supervise``). The worker, a forked or zygote-forked child, runs the calls one
at a time and restores the global state each may have changed (``_worker_serve``, ``_State``).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import os
import pickle
import secrets
import socket
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any

from pytest_gpucase.run.isolation.child import (
    _envelope_noting,
    _flush_std_streams,
    _forked_child,
    _save_coverage,
    _write_all,
)
from pytest_gpucase.run.isolation.proctree import (
    MARKER_ENV,
    adopt_orphans,
    now_ticks,
    own,
    thread_count,
)
from pytest_gpucase.run.isolation.result import ChildResult, StartMethod
from pytest_gpucase.run.isolation.supervise import (
    _PENDING,
    _Interruptible,
    _Run,
    _Supervisor,
    reap_pending,
)
from pytest_gpucase.run.isolation.zygote import _receive_exactly, _Zygote, forkserver

__all__ = ["WorkerPool", "close_pools"]

# Every pool of the session, for ``close_pools`` (``shutdown``).
_POOLS: list[WorkerPool] = []


class WorkerPool:
    """Long-lived children that run calls one after another, by key (device, environment,
    and the case in ``case`` isolation), to amortize a device context over many runs.

    A worker ends on anything it cannot vouch for: a crash, a timeout, a result refused,
    a process left behind, or global state it cannot restore (``_State``); the caller
    retires it after any failure too (``retire``) and confirms that failure in a fresh
    child. ``shutdown`` ends every pool's workers.
    """

    def __init__(self) -> None:
        self.workers: dict[Any, _Worker] = {}
        _POOLS.append(self)

    def run(self, key: Any, func: Callable[..., Any], *args: Any, timeout: float,
            env: Mapping[str, str] | None = None, start_method: StartMethod = "fork",
            memory_limit: int | None = None, exclusive: bool = False,
            marks: Mapping[str, str] | None = None) -> ChildResult:
        """``func(*args)`` in the worker of ``key`` (started now if there is none); with
        ``exclusive``, the other workers end first (one case's worker at a time). ``marks``
        as ``run_in_child`` has them."""
        if exclusive:
            for other in [k for k in self.workers if k != key]:
                self.retire(other)
        worker = self.workers.get(key)
        if worker is None:
            worker = self.workers[key] = _Worker(start_method, env or {})
        result = worker.call(func, args, timeout, memory_limit, marks)
        if not worker.usable:
            del self.workers[key]
        return result

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
                gc.freeze()
                threaded, parent = thread_count() > 1, os.getpid()
                pid = os.fork()
                if pid == 0:  # pragma: no cover - the worker
                    _forked_child(nulls[0], nulls[1], theirs.fileno(), (mine.fileno(),),
                                  child_env, threaded, parent, _worker_serve, (theirs.fileno(),),
                                  name="worker")
                own(pid)
                self.pid = pid
                with contextlib.suppress(OSError):
                    os.setpgid(pid, pid)
        finally:
            theirs.close()
            for fd in nulls:
                os.close(fd)
        self.sock = mine
        self.usable = True

    def call(self, func: Callable[..., Any], args: tuple[Any, ...], timeout: float,
             memory_limit: int | None, marks: Mapping[str, str] | None = None) -> ChildResult:
        if not timeout >= 0:
            raise ValueError(f"timeout must be a number of seconds >= 0, not {timeout!r}")
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
        return result

    def close(self) -> None:
        """End the worker: it exits when its socket closes (killed if it does not)."""
        if not self.usable:
            return
        self.usable = False
        self.sock.close()
        _PENDING.append(_Run(self.pid, self.token, None, zygote=self.zygote))


# --- in the worker ---------------------------------------------------------------------------

def _worker_serve(sock_fd: int) -> None:  # pragma: no cover - the worker
    """Run the calls the parent sends, one at a time, each with its own pipes."""
    sock = socket.socket(fileno=sock_fd)
    null = os.open(os.devnull, os.O_RDWR)
    while True:
        data, fds, _, _ = socket.recv_fds(sock, 1 << 16, 3)
        if len(data) < 8 or len(fds) != 3:
            _flush_std_streams()
            _save_coverage()
            os._exit(0)
        size = int.from_bytes(data[:8], "little")
        job = _receive_exactly(sock, size + 8, data)[8:]
        out_w, err_w, res_w = fds
        state = _State()
        _flush_std_streams()
        os.dup2(out_w, 1)
        os.dup2(err_w, 2)
        os.close(out_w)
        os.close(err_w)

        restored: list[bool] = []
        payload = _envelope_noting(res_w, _unpickle_and_call, (job,), functools.partial(
            _restore, state, restored))
        retire = restored != [True]
        _flush_std_streams()
        try:
            _write_all(res_w, payload)
        except BaseException:
            retire = True
        os.dup2(null, 1)
        os.dup2(null, 2)
        os.close(res_w)
        if retire:
            _save_coverage()
            os._exit(0)


def _unpickle_and_call(job: bytes) -> Any:  # pragma: no cover - the worker
    func, args = pickle.loads(job)  # the parent's own data
    return func(*args)


def _restore(state: _State, found: list[bool]) -> dict[str, Any]:  # pragma: no cover
    """Restore the worker's state after a call; the result says whether the worker ends."""
    found.append(state.restore())
    return {"retire": not found[-1]}


class _State:  # pragma: no cover - the worker
    """The global state a run may change, saved before it and restored after it.

    ``restore`` returns False when it cannot be (the worker then ends): a device left in
    an error state, a failed restore.
    """

    def __init__(self) -> None:
        self.environ = dict(os.environ)
        self.cwd = os.getcwd()
        self.path = list(sys.path)
        self.modules = set(sys.modules)
        self.random = __import__("random").getstate()
        torch = sys.modules.get("torch")
        self.torch: dict[str, Any] = {}
        if torch is not None:
            backends = torch.backends
            self.torch = {
                "grad": torch.is_grad_enabled(),
                "dtype": torch.get_default_dtype(),
                "deterministic": torch.are_deterministic_algorithms_enabled(),
                "warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
                "matmul_tf32": backends.cuda.matmul.allow_tf32,
                "precision": torch.get_float32_matmul_precision(),
                "cudnn": (backends.cudnn.enabled, backends.cudnn.benchmark,
                          backends.cudnn.deterministic, backends.cudnn.allow_tf32),
                "threads": torch.get_num_threads(),
                "rng": torch.random.get_rng_state(),
                "cuda": torch.cuda.is_initialized(),
            }
            if self.torch["cuda"]:
                self.torch["device"] = torch.cuda.current_device()
                self.torch["cuda_rng"] = torch.cuda.get_rng_state_all()

    def restore(self) -> bool:
        try:
            os.environ.clear()
            os.environ.update(self.environ)
            os.chdir(self.cwd)
            sys.path[:] = self.path
            for name in set(sys.modules) - self.modules:
                if name.startswith("gpucase_case_"):  # a case's own code: never shared
                    del sys.modules[name]
            __import__("random").setstate(self.random)
            torch = sys.modules.get("torch")
            if torch is None or not self.torch:
                return True
            saved, backends = self.torch, torch.backends
            if torch.cuda.is_initialized():
                torch.cuda.synchronize()  # a sticky device error raises here: end the worker
            torch.set_grad_enabled(saved["grad"])
            torch.set_default_dtype(saved["dtype"])
            if (torch.are_deterministic_algorithms_enabled(), saved["warn_only"]) != (
                    saved["deterministic"], torch.is_deterministic_algorithms_warn_only_enabled()):
                # As execute's switch does: the public call would import inductor (seconds).
                torch._C._set_deterministic_algorithms(saved["deterministic"],
                                                       warn_only=saved["warn_only"])
            backends.cuda.matmul.allow_tf32 = saved["matmul_tf32"]
            torch.set_float32_matmul_precision(saved["precision"])
            (backends.cudnn.enabled, backends.cudnn.benchmark, backends.cudnn.deterministic,
             backends.cudnn.allow_tf32) = saved["cudnn"]
            torch.set_num_threads(saved["threads"])
            torch.random.set_rng_state(saved["rng"])
            if saved["cuda"]:
                torch.cuda.set_device(saved["device"])
                torch.cuda.set_rng_state_all(saved["cuda_rng"])
            return True
        except Exception:
            return False
