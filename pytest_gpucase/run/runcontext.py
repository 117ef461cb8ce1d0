"""What every run of a session or a command shares: one ``RunContext``, built once.

A child's run depends on more than its ``RunSpec``: how the child starts, on which backend,
whether an asynchronous error is localized by a launch-blocking rerun, the memory limit, the
device pin of an xdist worker, the variables of the ``pytest_gpucase_run_env`` hook, the
variables every replay sets, the reference cache, and whether a reused child may run it.
Every entry point (case items, the ``gpu_case`` fixture, ``--gpu-ablate`` and ``gpucase
ablate``, ``gpucase minimize``, golden regeneration, the Recorder's narrowing and replay
check) builds one context and runs through ``run.parent.run_spec(spec, ctx)``, so that the
same case gets the same verdict whichever of them runs it. ``env`` is the one place a
child's environment is composed; the process layer adds only its own result token.

The pytest session builds its context in ``plugin.state``; a command builds one with
``RunContext.here``. No torch here: the parent's side only.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Literal

from pytest_gpucase.base.torch_import import cuda_initialized
from pytest_gpucase.case.keys import REPLAY_ENV

if TYPE_CHECKING:
    from pytest_gpucase.case.model import Case
    from pytest_gpucase.plan.runs import RunSpec
    from pytest_gpucase.run.isolation import StartMethod, WorkerPool
    from pytest_gpucase.run.reference_cache import ReferenceCache

__all__ = ["Isolation", "RunContext", "RunEnv"]

Isolation = Literal["item", "case", "worker"]
# Variables for one run's child, asked just before it starts (the pytest_gpucase_run_env
# hook, bound to the item that runs; ``gpucase ... --env NAME=VALUE`` on the command line).
RunEnv = Callable[["RunSpec"], Mapping[str, str]]


@dataclass(frozen=True)
class RunContext:
    """Everything a child's run depends on besides its ``RunSpec``."""

    start_method: StartMethod
    backend: str                       # the build's backend (cuda, rocm, cpu, ...)
    localize: bool = True              # rerun an asynchronous device error with launch blocking
    memory_limit: int | None = None    # bytes of the child tree; a case's own limit wins
    pin: Mapping[str, str] = field(default_factory=dict)  # --gpu-per-worker: device runs only
    run_env: RunEnv | None = None      # more variables, asked per run
    reference_cache: ReferenceCache | None = None
    isolation: Isolation = "item"
    pool: WorkerPool | None = None     # reused children, for isolation case or worker

    @classmethod
    def here(cls, backend: str, *, env: Mapping[str, str] | None = None,
             start_method: StartMethod | None = None, localize: bool = False,
             memory_limit: int | None = None) -> RunContext:
        """A command's context (``gpucase ablate``, ``minimize``, the Recorder's narrowing):
        a fresh child per run, with ``env`` given to every run (``--env NAME=VALUE``).

        Outside a pytest session no zygote was started before CUDA could be, so a process
        that initialized CUDA (a training run's Recorder) starts each child as a new
        interpreter (spawn); any other forks."""
        fixed = dict(env or {})
        return cls(start_method=start_method or ("spawn" if cuda_initialized() else "fork"),
                   backend=backend, localize=localize, memory_limit=memory_limit,
                   run_env=(lambda spec: fixed) if fixed else None)

    def env(self, spec: RunSpec) -> dict[str, str]:
        """The child's environment for ``spec``, composed here and nowhere else, each later
        source winning: the run's own variables (a case's, launch blocking), the worker's
        device pin (device runs only), the per-run variables (the hook), and what every
        replay and the reference cache set."""
        env = dict(spec.env)
        if self.pin and spec.device != "cpu":
            env.update(self.pin)
        if self.run_env is not None:
            env.update({str(k): str(v) for k, v in self.run_env(spec).items()})
        env[REPLAY_ENV] = "1"   # set by the child too: given here, no change a worker answers for
        if self.reference_cache is not None:
            env.update(self.reference_cache.env())
        return env

    def memory_limit_for(self, case: Case) -> int | None:
        """The case's own ``memory_limit`` when it has one, else the context's."""
        return getattr(case, "memory_limit", None) or self.memory_limit

    def fresh(self) -> RunContext:
        """The same context for a fresh child per run (a reused child's failure judged again,
        a launch-blocking rerun)."""
        return replace(self, isolation="item", pool=None)

    def reuses(self) -> bool:
        """Whether runs go to reused children (not under spawn: each is a new interpreter)."""
        return self.isolation != "item" and self.pool is not None and self.start_method != "spawn"
