"""How one run's outputs are judged in the child: the comparison with the reference's, and
the label that tells the reference's printed output from the call's."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

import torch

from pytest_gpucase.case.model import Expectation
from pytest_gpucase.verdict.compare import Comparison, Tolerance, combine, compare

__all__ = ["OUTPUT_MARKS", "REFERENCE_OUTPUT", "compare_results", "labelled_output"]


# Written before the reference's output: a case that prints shows its lines twice, from the
# call and from the reference, which is otherwise hard to tell apart.
REFERENCE_OUTPUT = "--- gpucase: the reference (float64 on CPU) runs from here ---\n"
# The capture's marks (isolation): a clipped capture whose omitted middle holds the label
# says so, or its tail, all of it the reference's output, would read as the call's.
OUTPUT_MARKS = {REFERENCE_OUTPUT: "the reference's output (float64 on CPU) begins inside them"}


@contextlib.contextmanager
def labelled_output(label: str) -> Iterator[None]:
    """Write ``label`` to stdout and to stderr just before the block's first text on each.

    Only a stream the block writes to is labelled, so that a quiet reference adds no captured
    section to a report. Text written through ``sys.stdout``/``sys.stderr`` (print, logging,
    warnings shown) is seen; a write to the file descriptor itself (C code, a subprocess)
    is not, and stays unlabelled as before.
    """
    patched: list[Any] = []
    for stream in {id(s): s for s in (sys.stdout, sys.stderr) if s is not None}.values():
        def labelled(text: str, stream: Any = stream, write: Any = stream.write) -> Any:
            if text:
                delattr(stream, "write")  # the stream's own write again: one label
                write(label)
            return write(text)

        try:
            setattr(stream, "write", labelled)  # noqa: B010 - an instance's method, for a while
        except AttributeError:  # a stream that takes no attribute: labelled at once
            with contextlib.suppress(Exception):
                stream.write(label)
            continue
        patched.append(stream)
    try:
        yield
    finally:
        for stream in patched:
            with contextlib.suppress(AttributeError):  # gone at the first write
                delattr(stream, "write")


def compare_results(actual: dict[str, Any], expected: dict[str, Any],
                    expect: Expectation) -> Comparison:
    tolerances = {}
    for name, override in expect.tolerance.items():
        # ulps alone: only the ULP test applies (atol and rtol 0), as the message says.
        tolerances[getattr(torch, name)] = Tolerance(
            rtol=override.rtol or 0.0, atol=override.atol or 0.0, ulps=override.ulps,
            source=f"case.toml [expect.tolerance.{name}]")
    return combine(compare(actual[key], expected[key], tolerances=tolerances,
                           equal_nan=expect.equal_nan, check_dtype=False, path=key)
                   for key in actual)
