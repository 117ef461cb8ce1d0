"""Record the first failure of a training run as a case that ``pytest --gpu-cases`` replays.

Three lines in a training script::

    rec = Recorder("cases")
    loss_fn = rec.watch(loss_fn, name="ce_class4")
    for it, batch in enumerate(loader):
        with rec.step(it, "forward", ids=batch_ids):
            ...

The first exception raised inside a watched call (or inside ``rec.step``) is
written as a case directory: the call target, its tensor inputs with their exact
layout, its literal inputs, and an ``[origin]`` table with the context (error,
iteration, stage, versions, backend, sample ids). Later exceptions in the same
process are counted in that case (``[origin] later_errors``), not saved again.
The exception always propagates unchanged, and nothing here raises over it.

Expect policy: a captured case is written with ``[expect] outcome = "matches"``
and ``xfail = "captured failure: <type>: <message>; remove this line once fixed"``.
The replay is then a strict xfail while the failure reproduces, the fix shows up
as XPASS(strict), and once the line is deleted the case is a regression test
against the float64 CPU reference. Writing ``outcome = "raises"`` instead would
record the bug as the expected behaviour: the replay would be green while
training is broken, and the fix would turn it red. A case that cannot reproduce
the failure faithfully (call not importable, inputs not saved or skipped) gets
no xfail line: its replay fails loudly until the case is completed, instead of
passing as an expected failure for the wrong reason.

Snapshots: with ``snapshot="before"`` (the default) the tensor arguments, host and
device alike, are copied to the host before each call while together they fit
``snapshot_limit`` (device ones first, when only they fit): a call that changes
its input in place and then raises is saved with the input as it was passed, and
a sticky device error cannot lose a device input. Above the limit, or with
``snapshot="after"``, host tensors are saved as they are after the failure and
device tensors are copied after it if the device still answers. What was not
copied is still guarded, by a read of each tensor's version counter before the
call (no copy): when the failing call changed one in place, ``[origin] snapshot``
and a ``gpucase: note:`` say so, and how to save it as passed.

Narrowing: a watched module's failure also writes the innermost submodule that
raised and the single ATen op that raised, each kept only if it reproduces in a
fresh child. Each of them holds its own copy of the tensors it needs (an
embedding's weight, say), so the saved lines show sizes of 1 MiB and more, a note
says when the narrowed cases of one failure are large, and ``Recorder(narrow=False)``
writes the module's case alone.

The Recorder and its steps are in ``recorder``; what a case holds is built by ``inputs`` (the
watched call's arguments, the snapshot, the numeric context), ``write`` (the case document,
written once under a free name) and ``narrow`` (a module's narrowed cases), from the facts
``origin`` gathers (the watched call, the loop's position, the error).
"""

from __future__ import annotations

from pytest_gpucase.tools.record.recorder import DEFAULT_SNAPSHOT_LIMIT, Recorder, Step

__all__ = ["DEFAULT_SNAPSHOT_LIMIT", "Recorder", "Step"]
