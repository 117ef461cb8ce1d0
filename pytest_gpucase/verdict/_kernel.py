"""The speed-up kernel: tensor values judged by the rule of ``tolerance``, fast.

Nothing here decides what counts as close; it applies ``tolerance``'s rule to
whole tensors and tallies the result (``stats.TensorStats``) as cheaply as
it can. The rules (``compare``'s walk) call it through a few names only:

- ``equal_tensors(actual, expected)``: whether a single tensor pair is equal
  (so holds no NaN), answered in one cheap call; False may also mean "not
  known", and the walk then decides.
- ``small_close(actual, expected, tol, check_dtype)``: the greatest
  absolute and relative differences of a small floating pair that a screen
  alone proves close; None when it cannot, and the walk then decides.
- ``compare_values(actual, expected, tol, equal_nan, keep, scratch)``: every
  element of two strided tensors of one shape judged, as a ``TensorStats``;
  ``Scratch`` holds the buffers that one comparison reuses.
- ``SMALL_ELEMENTS`` and ``BATCH_ELEMENTS``: which tensors of a nested output
  the walk batches into one flat pass, and how many elements make a batch.

So the kernel can be replaced, on a device say, by one that keeps these
names and what they answer; the rules, the walk and the messages stay.

Performance design. Tensor values are compared on the actual tensor's device
in chunks, fast path first: a chunk whose values are equal costs one equality
test (which also proves it holds no NaN; on the CPU a ``memcmp`` and a sum,
several times faster than ``torch.equal``); any other chunk costs one
screening pass of a few cache-resident elementwise ops and one fused
reduction that yields its greatest absolute, relative and
excess-over-tolerance errors. Only a chunk the screen cannot clear is decided
element by element, and its accounting is bounded: a sum counts its
mismatches, one max reduction finds its worst element, and the few worst
candidates are drawn only from chunks that can still hold one of them. No
temporary is ever the size of the tensor, and nothing but a few scalars
reaches the host. On the CPU, a tensor of several chunks is shared by worker
threads that each run single-threaded torch ops: one barrier per call instead
of one per op, which is what keeps a comparison fast while other processes
compete for the cores. Small tensors of one dtype in a nested output are
batched into one flat pass. A single pair skips the walk when the equality
test (up to one chunk) or the screen alone (up to 65,536 elements) settles
it: a few torch calls, the same ops and verdict as the walk's chunk.

Every size below is a tuning constant, measured by benchmarks/bench_compare.py;
none changes a verdict.
"""

from __future__ import annotations

import cmath
import ctypes
import functools
import math
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from pytest_gpucase.base.dtypes import DTYPE_TABLE
from pytest_gpucase.base import backends
from pytest_gpucase.base.tensors import readable_address
from pytest_gpucase.verdict.stats import NonFinite, TensorStats
from pytest_gpucase.verdict.tolerance import (DEFAULT_TOLERANCES, Tolerance, compute_dtype,
                                              nan_max)

__all__ = [
    "BATCH_ELEMENTS",
    "CHUNK_ELEMENTS",
    "DEVICE_CHUNK_ELEMENTS",
    "SMALL_ELEMENTS",
    "Scratch",
    "compare_values",
    "equal_tensors",
    "screen_of",
    "small_close",
]

# Elements per chunk on the CPU: small enough that a chunk's scratch rows stay
# in cache between the few elementwise passes, large enough that per-op
# dispatch stays a small part (measured by benchmarks/bench_compare.py).
CHUNK_ELEMENTS = 1 << 18
# Elements per chunk on accelerators, where bandwidth is high and every chunk
# costs kernel launches and a host synchronization.
DEVICE_CHUNK_ELEMENTS = 1 << 22
# Tensors of at most this many elements in a nested output are batched with
# the others of their dtype and device into one flat pass: per call, a torch
# op costs microseconds whatever its size.
SMALL_ELEMENTS = 1 << 12
# A batch is compared once it holds this many elements.
BATCH_ELEMENTS = 1 << 18
# Worker threads are started only for tensors of at least this many chunks
# each: on a loaded machine starting one costs as much as several chunks.
_MIN_CHUNKS_PER_WORKER = 8
# Below torch's grain size (32768 elements) an op runs in the calling thread
# anyway; a chunk's ops reduce several rows at once.
_GRAIN_ELEMENTS = 1 << 12
# A chunk whose NaN and inf are at most one in this many elements decides them
# by index, and the rest as a finite chunk; with more, every test on every element.
_SPECIAL_SHARE = 4
# Up to this many elements the walk's own bookkeeping costs more than the screen, which
# the shortcut then saves; beyond, a pair the screen cannot clear would pay it twice.
_SCREEN_ONLY_ELEMENTS = 1 << 16
# Below this many bytes torch.equal's call costs no more than memcmp's.
_MEMCMP_BYTES = 1 << 12
# Up to this many NaN and inf in a chunk are counted one by one on the host.
_FEW_SPECIALS = 64
# Rows longer than this many blocks are searched block by block: a max per
# block is as cheap as a sum, while argmax, topk and nonzero over a whole
# chunk cost ten to twenty times as much.
_BLOCK = 1 << 10


def equal_tensors(actual: object, expected: object) -> bool:
    """The fast path of a single tensor pair: equal values (so no NaN) in one cheap call.

    Up to one chunk: the walk would judge such a pair as one chunk, whose
    first test is this one, so an unequal pair pays one early-stopping read
    of at most a chunk twice; beyond, the walk's own whole-tensor test does it.
    """
    return (
        isinstance(actual, torch.Tensor)
        and isinstance(expected, torch.Tensor)
        and actual.dtype == expected.dtype
        and actual.shape == expected.shape
        and actual.device == expected.device
        and actual.layout == torch.strided
        and expected.layout == torch.strided
        and not actual.is_meta
        and 0 < actual.numel() <= _chunk_elements(actual.device)
        and _equal(actual, expected)
    )


_SCREENED_DTYPES = tuple(getattr(torch, row.name)   # base.dtypes.DTYPE_TABLE
                         for row in DTYPE_TABLE if row.screened)


def small_close(
    actual: torch.Tensor,
    expected: torch.Tensor,
    tol: Tolerance,
    check_dtype: bool,
    scratch: Scratch | None = None,
) -> tuple[float, float] | None:
    """The fast path of a small single floating pair that is close: the screen alone.

    The same ops and the same test as the screen of the full path's one
    chunk (`_Judge.floating_chunk`), so the same verdict and the same
    greatest differences, with none of the walk's bookkeeping: a handful of
    torch calls, single-threaded past torch's grain size as the walk's are.
    Returns the pair's greatest absolute and relative differences; None when
    the screen cannot clear the pair (a mismatch, a NaN or inf, a value near
    the bound): the full path then decides and words the message. With a
    ``scratch``, the screen is computed in its rows and left there for
    ``compare_values`` of the same pair, which then starts past it.
    """
    if not (
        actual.dtype in _SCREENED_DTYPES
        and expected.dtype in _SCREENED_DTYPES
        and (actual.dtype == expected.dtype or not check_dtype)
        and actual.shape == expected.shape
        and actual.device == expected.device
        and actual.layout == torch.strided
        and expected.layout == torch.strided
        and not actual.is_meta
        and 0 < actual.numel() <= min(_SCREEN_ONLY_ELEMENTS, _chunk_elements(actual.device))
    ):
        return None
    threads = torch.get_num_threads()
    if actual.numel() <= _GRAIN_ELEMENTS or threads <= 1 or actual.device.type != "cpu":
        return _screened(actual, expected, tol, scratch)
    torch.set_num_threads(1)  # as compare_values does: no barrier per op under load
    try:
        return _screened(actual, expected, tol, scratch)
    finally:
        torch.set_num_threads(threads)


def _screened(
    actual: torch.Tensor, expected: torch.Tensor, tol: Tolerance, scratch: Scratch | None
) -> tuple[float, float] | None:
    screen = _screen(actual.dtype, expected.dtype, actual.device, tol)
    a, e = actual, expected
    if a.requires_grad or e.requires_grad:  # no graph is built for a verdict
        a, e = a.detach(), e.detach()
    if a.dtype != screen.cdt:
        a = a.to(screen.cdt)
    if e.dtype != screen.cdt:
        e = e.to(screen.cdt)
    diff = torch.sub(a, e).abs_()
    scale = torch.abs(e)
    rows = torch.stack((diff, torch.div(diff, scale)))
    # reshape: a channels_last or permuted pair stacks into rows no view can flatten.
    rows = rows if a.dim() == 1 else rows.reshape(2, -1)
    max_abs, max_rel = rows.amax(1).tolist()
    if math.isfinite(max_abs):
        if math.isnan(max_rel):  # 0/0 where both sides hold an exact zero
            max_rel = float(rows[1].nan_to_num_(nan=0.0, posinf=math.inf).amax())
        # The third test's row only when the first two cannot clear the pair.
        if screen.clears(max_abs, max_rel, math.inf) or screen.clears(
                max_abs, max_rel, float(torch.add(diff, scale, alpha=-tol.rtol).amax())):
            return nan_max(0.0, max_abs), nan_max(0.0, max_rel)
    if scratch is not None:
        # Handed on in the layout of `_Judge.floating_chunk`'s rows: diff, rel, -, scale.
        chunk = scratch.rows(5, rows.shape[1], screen.real, a.device)
        chunk[:2].copy_(rows)
        chunk[3].view(scale.shape).copy_(scale)
        flat_a, flat_e = a.reshape(-1), e.reshape(-1)  # as the chunk's loaded rows
        scratch.screened = (actual, expected, flat_a, flat_e, chunk, max_abs, max_rel)
    return None


def _load_memcmp() -> Callable[[int, int, int], int] | None:
    """The C library's memcmp, or None where there is none to load (the test falls back)."""
    try:
        memcmp = ctypes.CDLL(None).memcmp
    except (OSError, TypeError, AttributeError):
        return None
    memcmp.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
    memcmp.restype = ctypes.c_int
    return memcmp


_MEMCMP = _load_memcmp()
_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)
_BYTES_ARE_VALUES = frozenset({
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
    torch.float16, torch.bfloat16, torch.float32, torch.float64,
})


def _equal(actual: torch.Tensor, expected: torch.Tensor) -> bool:
    """Whether two tensors of one dtype and shape hold equal values and no NaN.

    True is always right; False may also answer equal values whose bytes
    differ (-0.0 against 0.0), which every caller then judges the slow way.
    On the CPU, ``torch.equal`` reads at a fraction of memory speed (about
    a tenth of a sum's, measured by benchmarks/bench_compare.py); the C
    library's ``memcmp`` reads at memory speed and releases the GIL, and for
    floating dtypes a finite sum proves the equal bytes hold no NaN.
    """
    nbytes = actual.numel() * actual.element_size()
    if not _memcmp_fits(actual, expected, nbytes):
        return torch.equal(actual, expected)
    a_ptr, e_ptr = readable_address(actual, nbytes), readable_address(expected, nbytes)
    if a_ptr is None or e_ptr is None:
        return torch.equal(actual, expected)
    if _MEMCMP is None or _MEMCMP(a_ptr, e_ptr, nbytes) != 0:
        return False
    if not actual.dtype.is_floating_point:
        return True
    return _no_nan(actual, expected)


def _memcmp_fits(actual: torch.Tensor, expected: torch.Tensor, nbytes: int) -> bool:
    """Whether the pair's bytes may be compared with ``memcmp`` (else ``torch.equal``)."""
    return not (
        _MEMCMP is None
        or nbytes < _MEMCMP_BYTES
        or actual.device.type != "cpu"
        or expected.device.type != "cpu"
        # Only dtypes whose bytes are their values (not quantized codes, whose
        # scale lives elsewhere, nor packed 4-bit ones, whose element_size lies).
        or actual.dtype not in _BYTES_ARE_VALUES
        or actual.dtype != expected.dtype
        or actual.shape != expected.shape
        # Only plain tensors: a subclass's data_ptr may be a wrapper's, a negative
        # view's bytes are the negation of its values.
        or type(actual) not in _PLAIN_TENSORS
        or type(expected) not in _PLAIN_TENSORS
        or actual.layout != torch.strided
        or expected.layout != torch.strided
        or actual.is_neg()
        or expected.is_neg()
        or not actual.is_contiguous()
        or not expected.is_contiguous()
    )


def _no_nan(actual: torch.Tensor, expected: torch.Tensor) -> bool:
    """Whether a floating pair of equal bytes holds no NaN (else ``torch.equal`` decides)."""
    # Equal bytes: NaN is the only way their values can differ.
    values = actual.detach()  # a reduction for a verdict builds no graph
    if actual.dtype == torch.float16:
        # Its sums overflow (65504); a max is NaN exactly where a NaN is.
        return not math.isnan(float(values.amax()))
    if actual.dtype in (torch.bfloat16, torch.float32, torch.float64):
        # A sum, the cheapest reduction (in bfloat16 several times cheaper
        # than a max, and than one accumulating in float32), is finite only
        # without NaN; an inf or an overflow leaves it to torch.equal.
        return math.isfinite(float(values.sum())) or torch.equal(actual, expected)
    return torch.equal(actual, expected)


# --------------------------------------------------------------------------
# Chunks, each settled by the cheapest test that can


class Scratch:
    """Per-chunk buffers reused across the chunks and tensors of one worker."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = {}
        # A pair the screen of `small_close` could not clear: (actual, expected, its
        # loaded rows a and e, the five chunk rows, max_abs, max_rel), for its judging.
        self.screened: tuple[Any, ...] | None = None

    def get(self, name: str, n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        key = (name, dtype, device)
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < n:
            buf = torch.empty(n, dtype=dtype, device=device)
            self._buffers[key] = buf
        return buf[:n]

    def rows(self, count: int, n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """`count` rows of n elements, contiguous, so that one reduction covers several."""
        return self.get("rows", count * n, dtype, device).view(count, n)

    def load(
        self, name: str, piece: torch.Tensor, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """Return the piece as a flat contiguous tensor of that dtype on that device."""
        if piece.dtype == dtype and piece.device == device and piece.is_contiguous():
            return piece.view(-1)
        if piece.device != device and piece.dtype != dtype:
            # Convert where the piece lives: some backends (MPS) hold no float64.
            piece = piece.to(dtype)
        buf = self.get(name, piece.numel(), dtype, device)
        buf.view(piece.shape).copy_(piece)
        return buf


def _chunk_elements(device: torch.device) -> int:
    return CHUNK_ELEMENTS if device.type == "cpu" else DEVICE_CHUNK_ELEMENTS


def _pieces(
    actual: torch.Tensor, expected: torch.Tensor, chunk: int, offset: int = 0
) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """Yield (flat offset, actual piece, expected piece) in row-major order, <= chunk each.

    Pieces are views: a non-contiguous one is copied into a chunk-sized buffer
    only when its values are needed, so no copy the size of the tensor is made.
    """
    n = actual.numel()
    if n == 0:
        return
    if actual.is_contiguous() and expected.is_contiguous():
        flat_a, flat_e = actual.view(-1), expected.view(-1)
        for start in range(0, n, chunk):
            yield offset + start, flat_a[start : start + chunk], flat_e[start : start + chunk]
        return
    # A non-contiguous tensor is cut along its leading dimension.
    rows = actual.shape[0]
    inner = n // rows
    if inner <= chunk:
        step = max(1, chunk // inner)
        for r in range(0, rows, step):
            yield offset + r * inner, actual[r : r + step], expected[r : r + step]
    else:
        for r in range(rows):
            yield from _pieces(actual[r], expected[r], chunk, offset + r * inner)


def compare_values(
    actual: torch.Tensor,
    expected: torch.Tensor,
    tol: Tolerance,
    equal_nan: bool,
    keep: int,
    scratch: Scratch,
) -> TensorStats:
    """Compare the values of two strided tensors of one shape; return what they add up to."""
    stats = TensorStats(keep)
    n = actual.numel()
    if n == 0:
        return stats
    chunk = _chunk_elements(actual.device)
    if (
        n > chunk
        and actual.dtype == expected.dtype
        and actual.device == expected.device
        and _equal(actual, expected)
    ):
        # Equal tensors, the common case of a fixed bug: one read, and one
        # parallel region; unequal ones stop at their first difference.
        stats.note(0.0, 0.0)
        return stats
    judge = _Judge(actual, expected, tol, equal_nan)
    screened, scratch.screened = scratch.screened, None
    if screened is not None and screened[0] is actual and screened[1] is expected:
        judge.screened = screened[2:]  # its one chunk, screened and found unequal
    pieces = _pieces(actual, expected, chunk)
    cpu = actual.device.type == "cpu" and expected.device.type == "cpu"
    threads = torch.get_num_threads() if cpu and n > _GRAIN_ELEMENTS else 1
    if threads <= 1:
        for offset, a, e in pieces:
            judge(scratch, stats, offset, a, e)
        return stats
    # Every op of a chunk would be one parallel region of `threads` threads;
    # while another process holds a core, each region waits for its slowest
    # thread. Single-threaded ops, in as many threads as torch would use, each
    # taking the next chunk when done, share the work without a barrier per
    # op and skip none of it when one of them is descheduled.
    workers = min(threads, -(-n // chunk) // _MIN_CHUNKS_PER_WORKER)
    torch.set_num_threads(1)  # this thread's own setting (OpenMP's is per thread)
    try:
        if workers <= 1:
            for offset, a, e in pieces:
                judge(scratch, stats, offset, a, e)
        else:
            _in_threads(judge, pieces, workers, stats)
    finally:
        # torch.set_num_threads also sets the default of threads started
        # later, ours included: put back the caller's.
        torch.set_num_threads(threads)
    return stats


def _in_threads(
    judge: _Judge,
    pieces: Iterator[tuple[int, torch.Tensor, torch.Tensor]],
    workers: int,
    stats: TensorStats,
) -> None:
    """Judge the pieces in `workers` threads (this one included), each taking the next piece."""
    lock = threading.Lock()
    results: list[TensorStats] = []
    errors: list[BaseException] = []

    def work() -> None:
        local, local_scratch = TensorStats(stats.keep), Scratch()
        try:
            torch.set_num_threads(1)
            while not errors:
                with lock:
                    piece = next(pieces, None)
                if piece is None:
                    break
                judge(local_scratch, local, *piece)
        except BaseException as exc:  # re-raised in the calling thread
            errors.append(exc)
        with lock:
            results.append(local)

    threads = [threading.Thread(target=work, daemon=True) for _ in range(workers - 1)]
    for thread in threads:
        thread.start()
    try:
        work()
    finally:
        for thread in threads:
            thread.join()
    if errors:
        raise errors[0]
    for result in results:
        stats.merge(result)


@functools.cache
def _ranks(real: torch.dtype) -> tuple[float, float, float]:
    """eps of a dtype, and the ranks of NaN and inf mismatches: above every number."""
    info = torch.finfo(real)
    top = torch.tensor(info.max, dtype=real)
    return info.eps, info.max, float(torch.nextafter(top, torch.zeros_like(top)))


for _real in (torch.float64, torch.float32):  # the real dtypes comparisons compute in: made
    _ranks(_real)  # at import, in the pytest process, not again in every child it forks


@dataclass(frozen=True)
class _Screen:
    """What proves a floating chunk close from its three greatest errors alone.

    Each test alone proves closeness; the margins cover the rounding of the
    screen's own arithmetic (done in `real`), so no mismatch slips through.
    """

    cdt: torch.dtype  # the dtype differences are computed in
    real: torch.dtype  # its real part's dtype
    atol: float
    abs_bound: float
    rel_bound: float
    slack: float  # per unit of max_abs + atol

    def clears(self, max_abs: float, max_rel: float, max_excess: float) -> bool:
        """Whether the chunk is close everywhere; max_abs finite, max_rel not NaN."""
        return (
            max_abs <= self.abs_bound
            or max_rel <= self.rel_bound
            or max_excess <= self.atol - self.slack * (max_abs + self.atol)
        )


def _screen(
    actual: torch.dtype, expected: torch.dtype, device: torch.device, tol: Tolerance
) -> _Screen:
    # By the tolerance's numbers: the same default under another source is the same screen.
    return _screen_numbers(actual, expected, device, tol.atol, tol.rtol, tol.ulps)


@functools.lru_cache(maxsize=256)
def _screen_numbers(actual: torch.dtype, expected: torch.dtype, device: torch.device,
                    atol: float, rtol: float, ulps: float | None) -> _Screen:
    cdt = compute_dtype(actual, expected, device)
    real = cdt.to_real()
    eps = _ranks(real)[0]
    margin = 1 - 4 * eps
    ulp_rel = 0.0
    if ulps is not None:
        # The spacing at |e| is more than |e| * eps / 2 in the actual dtype.
        ulp_rel = ulps * torch.finfo(actual.to_real()).eps / 2
    return _Screen(
        cdt=cdt,
        real=real,
        atol=atol,
        abs_bound=atol * margin,
        rel_bound=max(rtol, ulp_rel) * margin,
        slack=8 * eps,
    )


# The screens of a run's pairs on the CPU (each screened dtype against itself and against
# its float64 reference, under each default tolerance): made at import, in the pytest
# process, not again in every child it forks (90 page faults and 0.3 ms each).
for _a in _SCREENED_DTYPES:
    for _e in (_a, torch.float64):
        for _d in _SCREENED_DTYPES:
            _screen(_a, _e, torch.device("cpu"), DEFAULT_TOLERANCES[_d])

screen_of = _screen  # for _small, which decides the same screen's clear passes in Python


class _Judge:
    """Decides the chunks of one tensor pair; its constants are computed once."""

    def __init__(
        self, actual: torch.Tensor, expected: torch.Tensor, tol: Tolerance, equal_nan: bool
    ) -> None:
        self.device = actual.device
        self.actual_dtype, self.expected_dtype = actual.dtype, expected.dtype
        self.floating = actual.dtype.is_floating_point or actual.dtype.is_complex
        # Equal values prove a chunk equal, and (NaN != NaN) free of NaN.
        self.screen_equal = actual.dtype == expected.dtype and actual.device == expected.device
        self.tol, self.equal_nan = tol, equal_nan
        if self.floating:
            self.screen: _Screen | None = _screen(actual.dtype, expected.dtype, actual.device, tol)
            self.cdt, self.real = self.screen.cdt, self.screen.real
        else:
            self.screen = None
            self.cdt = actual.dtype
            self.real = torch.float64 if backends.float64_on(actual.device.type) else torch.float32
        _, self.nan_rank, self.inf_rank = _ranks(self.real)
        self.screened: tuple[Any, ...] | None = None

    def __call__(
        self,
        scratch: Scratch,
        stats: TensorStats,
        offset: int,
        a_piece: torch.Tensor,
        e_piece: torch.Tensor,
    ) -> None:
        if self.screen_equal and self.screened is None and _equal(a_piece, e_piece):
            stats.note(0.0, 0.0)
            return
        if self.floating:
            self.floating_chunk(scratch, stats, offset, a_piece, e_piece)
        else:
            self.exact_chunk(scratch, stats, offset, a_piece, e_piece)

    def floating_chunk(
        self,
        scratch: Scratch,
        stats: TensorStats,
        offset: int,
        a_piece: torch.Tensor,
        e_piece: torch.Tensor,
    ) -> None:
        tol = self.tol
        if self.screened is not None:  # small_close's screen, which did not clear it
            (a, e, rows, max_abs, max_rel), self.screened = self.screened, None
            n = a.numel()
            finite = math.isfinite(max_abs)
        else:
            a = scratch.load("a", a_piece, self.cdt, self.device)
            e = scratch.load("e", e_piece, self.cdt, self.device)
            n = a.numel()
            rows = scratch.rows(5, n, self.real, self.device)
            # The screen: four cache-resident passes and one reduction of three rows.
            if self.cdt.is_complex:
                torch.abs(torch.sub(a, e), out=rows[0])
            else:
                torch.sub(a, e, out=rows[0]).abs_()
            torch.abs(e, out=rows[3])
            torch.div(rows[0], rows[3], out=rows[1])
            torch.add(rows[0], rows[3], alpha=-tol.rtol, out=rows[2])  # |a - e| - rtol * |e|
            max_abs, max_rel, max_excess = rows[:3].amax(dim=1).tolist()
            finite = math.isfinite(max_abs)
            if finite:
                if math.isnan(max_rel):  # 0/0 where both sides hold an exact zero
                    max_rel = float(rows[1].nan_to_num_(nan=0.0, posinf=math.inf).amax())
                assert self.screen is not None
                if self.screen.clears(max_abs, max_rel, max_excess):
                    stats.note(max_abs, max_rel)
                    return
        diff, rel, excess, scale, mismatch = rows[0], rows[1], rows[2], rows[3], rows[4]
        # Element by element, as torch.isclose decides; 1.0 marks a mismatch.
        allowed = excess
        if self.cdt.is_complex:
            torch.abs(torch.mul(e, tol.rtol), out=allowed).add_(tol.atol)
        else:
            torch.mul(scale, tol.rtol, out=allowed).add_(tol.atol)
        if finite:
            self.finite_mismatch(diff, allowed, scale, mismatch)
            torch.nan_to_num(rel, posinf=self.inf_rank, out=scale)
            self.account(stats, offset, mismatch, diff, rows[2:4])
            stats.note(max_abs, max_rel)
            return
        # NaN and inf are usually few: found in one pass and decided by index,
        # the rest as in the finite case, with the specials set to no difference.
        # diff > max is False at NaN: 1.0 at every finite difference, counted by a sum.
        count = n - int(torch.le(diff, torch.finfo(self.real).max, out=mismatch).sum())
        if count > n // _SPECIAL_SHARE:
            self.nonfinite_chunk(stats, offset, a, e, rows)
            return
        special = _nonzero_positions(mismatch.neg_().add_(1.0), count)
        a_s, e_s = a.index_select(0, special), e.index_select(0, special)
        diff_s = diff.index_select(0, special)
        diff.index_fill_(0, special, 0.0)
        rel.index_fill_(0, special, 0.0).nan_to_num_(nan=0.0, posinf=math.inf)
        # The greatest differences of the finite elements, passing or not: with
        # the specials' (NaN or inf, where one mismatches) they make the chunk's.
        finite_abs, finite_rel = rows[:2].amax(dim=1).tolist()
        if finite_abs >= self.inf_rank or self.inf_rank <= finite_rel < math.inf:
            # A finite difference ranked as NaN or inf: the general code words it.
            diff.index_copy_(0, special, diff_s)
            rel.index_copy_(0, special, torch.where(torch.isinf(diff_s), math.inf, math.nan))
            self.nonfinite_chunk(stats, offset, a, e, rows)
            return
        self.finite_mismatch(diff, allowed, scale, mismatch)
        torch.nan_to_num(rel, posinf=self.inf_rank, out=scale)
        # A special is close only when both sides are equal (infinities of one
        # sign) or, with equal_nan, both NaN; it ranks as NaN or inf.
        close_s = a_s == e_s
        if self.equal_nan:
            close_s |= torch.isnan(a_s) & torch.isnan(e_s)
        mismatched_s = close_s.logical_not_()
        rank_s = torch.nan_to_num(diff_s, nan=self.nan_rank, posinf=self.inf_rank)
        mismatch.index_copy_(0, special, mismatched_s.to(mismatch.dtype))
        diff.index_copy_(0, special, rank_s)
        scale.index_copy_(0, special, rank_s)
        worst_abs, worst_rel = self.account(stats, offset, mismatch, diff, rows[2:4])
        stats.note(
            nan_max(finite_abs, self.unrank(worst_abs)), nan_max(finite_rel, self.unrank(worst_rel))
        )
        if special.numel() <= _FEW_SPECIALS:  # a few numbers: counted on the host
            stats.nonfinite.add(
                _nonfinite_of(a_s.tolist(), e_s.tolist(), mismatched_s.tolist())
            )
        else:
            stats.nonfinite.add(_nonfinite_counts(a_s, e_s, mismatched_s))

    def finite_mismatch(
        self, diff: torch.Tensor, allowed: torch.Tensor, scale: torch.Tensor, mismatch: torch.Tensor
    ) -> None:
        """Write 1.0 where a finite difference is past the tolerance, 0.0 elsewhere."""
        # Comparisons written to a float row: several times faster than to bool.
        torch.gt(diff, allowed, out=mismatch)
        if self.tol.ulps is not None:
            mismatch.mul_(diff > _spacing_tensor(scale, self.actual_dtype).mul_(self.tol.ulps))

    def nonfinite_chunk(
        self,
        stats: TensorStats,
        offset: int,
        a: torch.Tensor,
        e: torch.Tensor,
        rows: torch.Tensor,
    ) -> None:
        """Decide a chunk where NaN or inf are many: every test on every element."""
        tol = self.tol
        diff, rel, allowed, scale, mismatch = rows[0], rows[1], rows[2], rows[3], rows[4]
        excess = allowed
        close = diff <= allowed
        if tol.ulps is not None:
            close |= diff <= _spacing_tensor(scale, self.actual_dtype).mul_(tol.ulps)
        close &= torch.isfinite(diff)  # inf - inf and NaN are never "close"
        close |= a == e
        if self.equal_nan:
            close |= torch.isnan(a) & torch.isnan(e)
        torch.logical_not(close, out=mismatch)
        rel.masked_fill_(torch.isinf(diff), math.inf)  # inf / inf: infinitely far, not NaN
        # Matching specials count as no difference, mismatches as themselves.
        passing_abs = float(torch.nan_to_num(diff * close, nan=0.0, posinf=0.0).amax())
        passing_rel = float(torch.nan_to_num(rel * close, nan=0.0, posinf=math.inf).amax())
        torch.nan_to_num(rel, nan=self.nan_rank, posinf=self.inf_rank, out=scale)
        torch.nan_to_num(diff, nan=self.nan_rank, posinf=self.inf_rank, out=excess)
        worst_abs, worst_rel = self.account(stats, offset, mismatch, excess, rows[2:4])
        stats.note(nan_max(passing_abs, self.unrank(worst_abs)),
                   nan_max(passing_rel, self.unrank(worst_rel)))
        if worst_abs > 0:
            stats.nonfinite.add(_nonfinite_counts(a, e, ~close))

    def unrank(self, rank: float) -> float:
        if rank >= self.nan_rank:
            return math.nan
        return math.inf if rank >= self.inf_rank else max(rank, 0.0)

    def exact_chunk(
        self,
        scratch: Scratch,
        stats: TensorStats,
        offset: int,
        a_piece: torch.Tensor,
        e_piece: torch.Tensor,
    ) -> None:
        wide = self.real
        a = scratch.load("a", a_piece, wide, self.device)
        e = scratch.load("e", e_piece, wide, self.device)
        n = a.numel()
        rows = scratch.rows(5, n, wide, self.device)
        diff, rel, key, scale, mismatch = rows[0], rows[1], rows[2], rows[3], rows[4]
        # Equality in the dtypes themselves: float64 cannot tell 2**62 from 2**62 + 1.
        torch.ne(a_piece, e_piece.to(self.device), out=mismatch.view(a_piece.shape))
        torch.sub(a, e, out=diff).abs_()
        if self.actual_dtype == torch.bool:
            rel.copy_(diff)  # a relative difference of bools means nothing: 0 or 1
        else:
            torch.div(diff, torch.abs(e, out=scale), out=rel)
            rel.nan_to_num_(nan=0.0, posinf=math.inf)
        max_abs, max_rel = rows[:2].amax(dim=1).tolist()
        stats.note(max_abs, max_rel)
        # Ranked one above the difference: a mismatch of 2**62 + 1 against 2**62
        # differs by 0 in float64 and must still rank above the matches.
        torch.add(diff, 1.0, out=key)
        torch.nan_to_num(rel, posinf=self.inf_rank, out=scale).add_(1.0)
        self.account(stats, offset, mismatch, key, rows[2:4])

    def account(
        self,
        stats: TensorStats,
        offset: int,
        mismatch: torch.Tensor,
        rank: torch.Tensor,
        ranks: torch.Tensor,
    ) -> tuple[float, float]:
        """Count a chunk's mismatches and keep its worst: a few reductions, however many.

        `mismatch` holds 1.0 at mismatches and 0.0 elsewhere; `rank` and
        ``ranks[1]`` rank the elements (positive at every mismatch) by absolute
        and relative difference; ``ranks`` is two rows of a chunk's scratch side
        by side, whose first may be `rank` itself: both are overwritten (so is
        `mismatch`), and both greatest ranks come from one reduction.
        Returns the chunk's greatest ranks among mismatches.
        """
        count = int(mismatch.sum())
        if not count:
            return 0.0, 0.0
        stats.mismatched += count
        key, rel_rank = ranks[0], ranks[1]
        torch.mul(rel_rank, mismatch, out=rel_rank)
        torch.mul(rank, mismatch, out=key)
        worst, worst_rel = ranks.amax(dim=1).tolist()
        if stats.worst_rel is None or worst_rel > stats.worst_rel[0]:
            stats.add_rel(worst_rel, offset + _first_max(rel_rank))
        # One max per chunk; indices only while this chunk can still hold one
        # of the worst `keep` (the first chunk, or one worse than all kept).
        if not stats.admits(worst):
            return worst, worst_rel
        # The chunk's worst by (-rank, index), as add_worst orders them: the
        # greatest ranks, and where ranks tie at the edge (torch's topk picks
        # any of them), the first of the tied ones by index.
        take = min(stats.keep, count)
        values, indices = _top(key, min(take + 1, key.numel()))
        if take < len(values) and values[take] == values[take - 1]:
            edge = values[take - 1]
            above = [(v, i) for v, i in zip(values, indices, strict=True) if v > edge]
            tied = _first_hits(torch.eq(key, edge, out=mismatch), take - len(above))
            for value, index in [*above, *((edge, i) for i in tied)]:
                stats.add_worst(value, offset + index)
        else:
            for value, index in zip(values[:take], indices[:take], strict=True):
                stats.add_worst(value, offset + index)
        return worst, worst_rel


def _nonfinite_of(a: list[complex], e: list[complex], mismatched: list[bool]) -> NonFinite:
    """_nonfinite_counts of a few values on the host, where each torch op costs more."""
    counts = NonFinite()
    for x, y, bad in zip(a, e, mismatched, strict=True):
        if not bad:
            continue
        if cmath.isnan(x):
            counts.nan_actual += 1
            counts.nan_both += cmath.isnan(y)
            continue
        if cmath.isinf(x):
            counts.inf_actual += 1
            counts.inf_expected_too += not cmath.isfinite(y)
        counts.nan_expected_only += cmath.isnan(y)
    return counts


def _block_maxima(row: torch.Tensor) -> torch.Tensor:
    """The greatest value of each block of _BLOCK elements of a flat row (the last may be short)."""
    full = row.numel() - row.numel() % _BLOCK
    head = row[:full].view(-1, _BLOCK).amax(dim=1)
    return head if full == row.numel() else torch.cat((head, row[full:].amax().view(1)))


def _block_elements(blocks: torch.Tensor, n: int) -> torch.Tensor:
    """The flat indices of the elements of these blocks of a row of n, in the blocks' order."""
    steps = torch.arange(_BLOCK, device=blocks.device)
    indices = (blocks.view(-1, 1) * _BLOCK + steps).view(-1)
    return indices if n % _BLOCK == 0 else indices[indices < n]


def _top(row: torch.Tensor, k: int) -> tuple[list[float], list[int]]:
    """torch.topk's values and indices of a flat row: drawn from its k greatest blocks.

    The k greatest values lie in the k blocks of greatest maxima (each of
    those holds a value at least as great as any outside them).
    """
    if row.numel() <= 8 * _BLOCK:
        values, indices = torch.topk(row, k)
        return values.tolist(), indices.tolist()
    maxima = _block_maxima(row)
    candidates = _block_elements(torch.topk(maxima, min(k, maxima.numel())).indices, row.numel())
    values, at = torch.topk(row.index_select(0, candidates), k)
    return values.tolist(), candidates.index_select(0, at).tolist()


def _first_max(row: torch.Tensor) -> int:
    """The index of the first greatest value of a flat row, as argmax: in its first block."""
    if row.numel() <= 8 * _BLOCK:
        return int(row.argmax())
    block = int(_block_maxima(row).argmax())
    return block * _BLOCK + int(row[block * _BLOCK : (block + 1) * _BLOCK].argmax())


def _first_hits(flags: torch.Tensor, k: int) -> list[int]:
    """The indices of the first k nonzero elements of a flat row of 0.0 and 1.0."""
    if flags.numel() <= 8 * _BLOCK:
        return flags.nonzero()[:k].view(-1).tolist()
    blocks = _block_maxima(flags).nonzero()[:k].view(-1)  # each holds at least one
    candidates = _block_elements(blocks, flags.numel())
    return candidates[flags.index_select(0, candidates).nonzero()[:k].view(-1)].tolist()


def _nonzero_positions(flags: torch.Tensor, count: int) -> torch.Tensor:
    """The indices of the `count` nonzero elements of a flat row of 0.0 and 1.0, in order."""
    if flags.numel() <= 8 * _BLOCK or count * 8 > flags.numel() // _BLOCK:
        return flags.nonzero().view(-1)
    candidates = _block_elements(_block_maxima(flags).nonzero().view(-1), flags.numel())
    return candidates[flags.index_select(0, candidates).nonzero().view(-1)]


def _nonfinite_counts(a: torch.Tensor, e: torch.Tensor, mismatched: torch.Tensor) -> NonFinite:
    """Where mismatched elements are NaN or infinite, on either side."""
    a_nan, a_inf = torch.isnan(a) & mismatched, torch.isinf(a) & mismatched
    e_nan = torch.isnan(e)
    return NonFinite(
        nan_actual=int(a_nan.sum()),
        nan_both=int((a_nan & e_nan).sum()),
        inf_actual=int(a_inf.sum()),
        inf_expected_too=int((a_inf & ~torch.isfinite(e)).sum()),
        nan_expected_only=int((e_nan & mismatched & ~torch.isnan(a)).sum()),
    )


def _spacing_tensor(magnitude: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Distance to the next representable value of dtype, at each magnitude."""
    info = torch.finfo(dtype.to_real())
    mantissa_bits = round(-math.log2(info.eps))
    # Below the smallest normal the spacing is constant (the smallest subnormal),
    # which is the spacing of the smallest normal's binade.
    _, exponent = torch.frexp(magnitude.clamp_min(info.tiny))
    # frexp gives |x| = m * 2**exponent with m in [0.5, 1): the binade is exponent - 1.
    return torch.exp2((exponent - (1 + mantissa_bits)).to(magnitude.dtype))
