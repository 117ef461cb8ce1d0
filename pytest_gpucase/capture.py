"""The Recorder, and the calls that saved module and op cases name (public).

Saved cases write ``call = "pytest_gpucase.capture:replay_module"`` (or ``replay_op``,
``replay_function``), and the ``case.py`` written beside a model calls ``build_model``:
those names resolve here for good. The child that replays such a case imports only the
replay functions; the Recorder (``pytest_gpucase.tools.record``) is loaded when asked for.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pytest_gpucase.case.keys import REPLAY_ENV, REPLAY_FUNCTION, REPLAY_MODULE, REPLAY_OP
from pytest_gpucase.run.replay import (
    build_model,
    load_script,
    replay_function,
    replay_module,
    replay_op,
)

if TYPE_CHECKING:
    from pytest_gpucase.tools.record import DEFAULT_SNAPSHOT_LIMIT, Recorder, Step

__all__ = ["DEFAULT_SNAPSHOT_LIMIT", "REPLAY_ENV", "REPLAY_FUNCTION", "REPLAY_MODULE", "REPLAY_OP",
           "Recorder", "Step", "build_model", "load_script", "replay_function", "replay_module",
           "replay_op"]

_RECORDER_NAMES = ("DEFAULT_SNAPSHOT_LIMIT", "Recorder", "Step")


def __getattr__(name: str) -> object:
    if name in _RECORDER_NAMES:
        from pytest_gpucase.tools import record

        return getattr(record, name)
    raise AttributeError(f"module 'pytest_gpucase.capture' has no attribute {name!r}")
