"""What "the same failure" means, once, for every tool that asks.

A ``Failure`` is what a run (or a recorded case's ``[origin]``) failed with: the
exception type, its message, the captured stderr and the device type it happened on.
``same_failure(recorded, found)`` says whether ``found`` is that failure again:

- both have a triage class (``triage.failure_class``): the classes must be equivalent
  (``triage.same_failure``: a CUDA device-side assert is met by the IndexError the CPU
  raises for the same inputs); and when both happened on the same device type and
  neither class is one whose words change with the device (``CROSS_DEVICE_CLASSES``)
  or with the check that caught it (``CAUGHT_BY_ANY_CHECK``: a NaN), the message
  *shapes* must be equal too;
- otherwise the exception types must be equal and so must the message shapes.

A message a capture shortened (``cut``: its first line cut to a bound, ending in
``CUT_MARK``) still matches its full form: the kept prefix's shape, up to its last whole
word, must begin the other's shape (``same_shape``).

A message's shape is its first line with what changes from run to run written as
placeholders: numbers (``N``), runs of sizes (``[N]``, ``N``), hexadecimal addresses
(``0x?``) and file paths (``<path>``), its secrets removed (``base.secrets``). So "index 7
is out of bounds for dimension 0 with size 5" and "index 2 is out of bounds for dimension 0
with size 1" are the same failure, while "The size of tensor a (5) must match the size of
tensor b (3) ..." and "shape '[0, 3]' is invalid for input of size 12" are not, though
both are RuntimeErrors.

Used by ``gpucase minimize`` (a smaller case must fail the same way), ``gpucase ablate``
(still fails / fails differently), the xfail match of a case (``plugin.items``) and
``gpucase validate``. Imports no torch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from pytest_gpucase.base.secrets import remove_secrets
from pytest_gpucase.verdict.triage import NONFINITE, current_class, failure_class
from pytest_gpucase.verdict.triage import same_failure as same_class

__all__ = ["CAUGHT_BY_ANY_CHECK", "CROSS_DEVICE_CLASSES", "CUT_MARK", "Failure", "cut",
           "first_line", "message_shape", "same_failure", "same_shape"]

# Classes whose message is written by a different layer on each device (a kernel's assert
# on CUDA, the operator's own check on the CPU), so that their words say nothing about
# whether two failures are the same: the class alone decides.
CROSS_DEVICE_CLASSES = frozenset({"device-side-assert", "index-out-of-range",
                                  "value-out-of-range"})
# Classes whose message is written by whichever check caught the failure, on any device: a
# NaN is told by the Recorder's guard at capture ("non-finite loss of f: ..."), by the
# replay's finiteness check ("non-finite output: ..."), by anomaly mode or by the user's
# own check. Their words say where it was caught, not what failed: the class decides.
CAUGHT_BY_ANY_CHECK = frozenset({NONFINITE})
# What ends a message cut to a bound (``cut``), and the least of it that must be kept for the
# prefix to say anything: below it, a cut message matches nothing but itself.
CUT_MARK = "\u2026"
_MIN_KEPT = 48


@dataclass(frozen=True)
class Failure:
    """One failure: exception type, message, captured stderr, and the device type it hit.

    ``error_type`` None is a failure without an exception (outputs that differ: the
    message is then the verdict's summary). ``device`` is kept as its type (``cuda:1`` and
    a ROCm build's ``rocm`` are ``cuda``). ``failure_class`` is the triage class when it
    is known already (``[origin] failure_class``, a former name read as the class it
    became: ``nan`` is ``nonfinite``); left None, it is read off the texts.
    """

    error_type: str | None
    message: str = ""
    stderr: str = ""
    device: str | None = None
    failure_class: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "device", _device_type(self.device))
        if self.failure_class is not None:
            object.__setattr__(self, "failure_class", current_class(self.failure_class))

    @classmethod
    def from_text(cls, text: str, stderr: str = "", device: str | None = None,
                  failure_class: str | None = None) -> Failure:
        """A failure written as a traceback ends (``RuntimeError: CUDA error: ...``), as
        ``[origin] error`` holds it; text without a type is a message alone."""
        found = re.match(r"\s*([A-Za-z_][\w.]*)(?::\s?|\s*$)", text)
        if found is None or not _looks_like_type(found[1]):
            return cls(None, text, stderr, device, failure_class)
        return cls(found[1], text[found.end():], stderr, device, failure_class)

    @property
    def kind(self) -> str | None:
        """The triage class (``triage.FAILURE_CLASSES``), or None when triage knows none."""
        if self.failure_class is not None:
            return self.failure_class
        if self.error_type is None:
            return None
        return failure_class(self.error_type, self.message, self.stderr)

    @property
    def shape(self) -> str:
        """The message's shape (``message_shape``)."""
        return message_shape(self.message)

    def describe(self) -> str:
        """``RuntimeError: <first line>``, as a person reads it first."""
        line = first_line(self.message)
        if self.error_type is None:
            return line or "no exception"
        name = self.error_type.rsplit(".", 1)[-1]
        return f"{name}: {line}" if line else name


def same_failure(recorded: Failure, found: Failure) -> bool:
    """Whether ``found`` is the failure ``recorded`` again (see the module's docstring)."""
    recorded_class, found_class = recorded.kind, found.kind
    if recorded_class is not None and found_class is not None:
        if not same_class(recorded_class, found_class):
            return False
        if (recorded.device is None or recorded.device != found.device
                or {recorded_class, found_class} & (CROSS_DEVICE_CLASSES
                                                    | CAUGHT_BY_ANY_CHECK)):
            return True
        return same_shape(recorded.shape, found.shape)
    return (_short(recorded.error_type) == _short(found.error_type)
            and same_shape(recorded.shape, found.shape))


def cut(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` characters, ending in ``CUT_MARK`` when it was: the one way
    a message is shortened, so that ``same_shape`` knows a shortened one."""
    return text if len(text) <= limit else text[:max(limit - 1, 0)] + CUT_MARK


def same_shape(one: str, other: str) -> bool:
    """Whether two message shapes are the same, one of them possibly ``cut``: then what was
    kept of it, up to its last whole word (the cut may end inside a word or a number),
    begins the other."""
    if one == other:
        return True
    for short, full in ((one, other), (other, one)):
        if not short.endswith(CUT_MARK):
            continue
        kept = short[:-len(CUT_MARK)]
        # The last word may be cut short ("gradie…"), a number too ("[N, N…" of "[N, N]").
        head, space, _ = kept.rpartition(" ")
        kept = head if space else ""
        if len(kept) >= _MIN_KEPT and full.removesuffix(CUT_MARK).startswith(kept):
            return True
    return False


def first_line(text: str) -> str:
    """The first line of ``text`` that holds anything, stripped."""
    for line in text.splitlines():
        if line.strip():
            return line.strip()
    return ""


_ADDRESS = re.compile(r"\b0[xX][0-9a-fA-F]+\b")
# A file path: one ending in a file name (``cases/x/case.toml``, ``C:\\work\\m.py``), or of
# two or more components (``/tmp/x``); "a/b" in prose and fractions ("8/16") are left alone.
_PATH = re.compile(r"(?<![\w.])(?:[A-Za-z]:)?[\w.+~\-]*(?:[\\/][\w.+\-]+)+\.[A-Za-z]\w*"
                   r"|(?<![\w.])(?:[A-Za-z]:)?(?:[\\/][\w.+\-]+){2,}[\\/]?"
                   r"|(?<![\w.])~(?:[\\/][\w.+\-]+)+[\\/]?")  # below a home the capture wrote as ~
_SIZES = re.compile(r"(?<![\w.])\d+(?:[x\u00d7]\d+)+(?![\w.])")
_NUMBER = re.compile(r"(?<![\w.])[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?(?![\w.])"
                     r"|(?<![\w.])[-+]?(?:inf|nan)(?![\w.])")
_RUN = re.compile(r"N(?:\s*,\s*N)+")
_SPACE = re.compile(r"\s+")


def message_shape(text: str) -> str:
    """The first line of a message with numbers, sizes, addresses and paths as placeholders,
    and without secrets (``base.secrets``: a message the capture wrote without them is the
    same failure as the raw one)."""
    line = remove_secrets(first_line(text))
    line = _ADDRESS.sub("0x?", line)
    line = _PATH.sub("<path>", line)
    line = _SIZES.sub("N", line)
    line = _NUMBER.sub("N", line)
    line = _RUN.sub("N", line)
    return _SPACE.sub(" ", line)


def _short(error_type: str | None) -> str | None:
    return None if error_type is None else error_type.rsplit(".", 1)[-1]


def _looks_like_type(name: str) -> bool:
    """``RuntimeError``, ``torch.OutOfMemoryError``, ``Crash``: a capitalized last part,
    after any leading underscores (torch's ``_LinAlgError``); or a module's lower-case one
    named as an error (``cv2.error``). "silent: NaN loss at ..." (a recorded failure
    without an exception) is not one."""
    last = name.rsplit(".", 1)[-1]
    return (last.lstrip("_")[:1].isupper()
            or ("." in name and last.lower().endswith(("error", "exception"))))


def _device_type(device: str | None) -> str | None:
    """``cuda:0`` -> ``cuda``; a ROCm backend runs as torch's ``cuda`` device type."""
    if not device:
        return None
    kind = device.split(":", 1)[0].strip().lower()
    return "cuda" if kind in ("rocm", "hip") else kind
