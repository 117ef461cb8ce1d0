"""The old home of run planning, kept so that ``from .matrix import ...`` still works.

Planning (requirements against the environment, device lists, the expansion of
a case into runs) lives in ``plan.py``; ``Case.matrix`` is the ``[matrix]``
table (``case.Requirements``); the compatibility table of a report is
``report.py``'s. Import from ``plan`` in new code.
"""

from __future__ import annotations

from .plan import (
    DEFAULT_DEVICES,
    RunSpec,
    device_skip,
    evaluate,
    expand,
    saved_dtype,
    saved_float_dtype,
)

__all__ = ["DEFAULT_DEVICES", "RunSpec", "device_skip", "evaluate", "expand", "saved_dtype",
           "saved_float_dtype"]
