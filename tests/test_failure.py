"""What "the same failure" means (verdict/failure.py): class, then message shape."""

from __future__ import annotations

import pytest

from pytest_gpucase.verdict.failure import Failure, message_shape, same_failure
from pytest_gpucase.verdict.triage import same_failure as same_class

CUDA_ASSERT = Failure.from_text(
    "RuntimeError: CUDA error: device-side assert triggered\nCUDA kernel errors might be ...",
    stderr="Loss.cu:250: nll_loss_forward: block: [0,0,0], thread: [2,0,0] Assertion "
           "`t >= 0 && t < n_classes` failed.", device="cuda")


@pytest.mark.parametrize(("text", "shape"), [
    ("index 7 is out of bounds for dimension 0 with size 5",
     "index N is out of bounds for dimension N with size N"),
    ("The size of tensor a (5) must match the size of tensor b (3) at non-singleton "
     "dimension 1",
     "The size of tensor a (N) must match the size of tensor b (N) at non-singleton dimension N"),
    ("mat1 and mat2 shapes cannot be multiplied (4x3 and 5x6)",
     "mat1 and mat2 shapes cannot be multiplied (N and N)"),
    ("shape '[2, 3, 4]' is invalid for input of size 12", "shape '[N]' is invalid for input of "
     "size N"),
    ("Expected all tensors to be on the same device, but found at least two devices, cuda:0 "
     "and cpu!", "Expected all tensors to be on the same device, but found at least two "
                 "devices, cuda:N and cpu!"),
    ("CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 79.15 GiB total capacity)",
     "CUDA out of memory. Tried to allocate N GiB (GPU N; N GiB total capacity)"),
    ("object at 0x7f3a2c0d1e50 in /home/me/proj/model.py failed",
     "object at 0x? in <path> failed"),
    ("cases/x/case.toml: run timed out after 5 s", "<path>: run timed out after N s"),
    ("ratio 8/16 of a/b", "ratio N/N of a/b"),
    ("expected scalar type Float but found Double", "expected scalar type Float but found Double"),
    ("\n\n  float32 mat1 on sm_80 failed with lr=1e-05\nsecond line",
     "float32 mat1 on sm_80 failed with lr=N"),
])
def test_a_message_shape_keeps_the_words_and_drops_what_changes(text: str, shape: str) -> None:
    assert message_shape(text) == shape


def test_from_text_reads_the_type_as_a_traceback_ends() -> None:
    failure = Failure.from_text("torch.OutOfMemoryError: CUDA out of memory.", device="cuda:1")
    assert (failure.error_type, failure.message, failure.device) == (
        "torch.OutOfMemoryError", "CUDA out of memory.", "cuda")
    assert failure.kind == "oom"
    assert Failure.from_text("ValueError").error_type == "ValueError"
    assert Failure.from_text("x", device="rocm").device == "cuda"
    silent = Failure.from_text("silent: NaN loss at iteration 880")
    assert silent.error_type is None
    assert silent.describe() == "silent: NaN loss at iteration 880"
    assert CUDA_ASSERT.describe() == "RuntimeError: CUDA error: device-side assert triggered"
    # torch.linalg's error is torch._C._LinAlgError; OpenCV raises cv2.error: types both,
    # not a silent failure's words (whose known failure any wrong values would then meet).
    linalg = Failure.from_text("_LinAlgError: linalg.cholesky: The factorization could not "
                               "be completed because the input is not positive-definite")
    assert linalg.error_type == "_LinAlgError" and linalg.message.startswith("linalg.cholesky")
    assert Failure.from_text("cv2.error: OpenCV(4.8.0) bad").error_type == "cv2.error"
    assert Failure.from_text("mismatch: out['loss']: values differ").error_type is None


def test_a_cuda_assert_is_met_by_the_cpus_index_error_and_by_itself() -> None:
    cpu = Failure("IndexError", "Target 4 is out of bounds.", device="cpu")
    assert CUDA_ASSERT.kind == "index-out-of-range"
    assert same_failure(CUDA_ASSERT, cpu)
    again = Failure("RuntimeError", "CUDA error: device-side assert triggered", device="cuda")
    assert same_failure(CUDA_ASSERT, again)  # a cross-device class: the words do not decide
    assert not same_failure(CUDA_ASSERT, Failure("ValueError", "bad", device="cpu"))


def test_the_same_class_on_the_same_device_needs_the_same_message_shape() -> None:
    recorded = Failure("RuntimeError", "CUDA out of memory. Tried to allocate 2.00 GiB",
                       device="cuda")
    assert same_failure(recorded, Failure("torch.OutOfMemoryError",
                                          "CUDA out of memory. Tried to allocate 1.50 GiB",
                                          device="cuda"))
    assert not same_failure(recorded, Failure(
        "RuntimeError", "CUDA out of memory while creating the cuBLAS handle", device="cuda"))
    # On another device type (or where the recorded device is unknown), the class decides.
    assert same_failure(recorded, Failure(
        "RuntimeError", "CUDA out of memory while creating the cuBLAS handle", device="cpu"))


def test_without_a_class_the_type_and_the_message_shape_decide() -> None:
    original = Failure("RuntimeError", "The size of tensor a (5) must match the size of "
                       "tensor b (3) at non-singleton dimension 1", device="cpu")
    smaller = Failure("RuntimeError", "The size of tensor a (2) must match the size of "
                      "tensor b (1) at non-singleton dimension 1", device="cpu")
    other = Failure("RuntimeError", "shape '[0, 3]' is invalid for input of size 0",
                    device="cpu")
    assert original.kind is None
    assert same_failure(original, smaller)
    assert not same_failure(original, other)
    assert not same_failure(original, Failure("ValueError", original.message, device="cpu"))
    mismatch = Failure(None, "outputs differ from the reference: out: 3 / 8 elements differ")
    assert same_failure(mismatch, Failure(None, "outputs differ from the reference: out: 1 / 2 "
                                                "elements differ"))
    assert not same_failure(mismatch, Failure(None, "outputs differ from the reference: "
                                                    "out['loss']: values differ"))


def test_a_class_given_by_the_record_wins_over_the_text() -> None:
    recorded = Failure("RuntimeError", "CUDA error: device-side assert triggered",
                       device="cuda", failure_class="index-out-of-range")
    assert recorded.kind == "index-out-of-range"
    assert same_failure(recorded, Failure("IndexError", "index out of range in self",
                                          device="cpu"))


def test_a_nan_is_the_same_failure_whichever_check_caught_it() -> None:
    """The Recorder's guard words a NaN loss one way at capture, the replay's finiteness
    check another, anomaly mode a third: all the nonfinite class, on the same device too."""
    captured = Failure.from_text("FloatingPointError: non-finite loss of scaled_sum: out "
                                 "holds 1 NaN", device="cpu", failure_class="nan")
    assert same_failure(captured, Failure("FloatingPointError",
                                          "non-finite output: out holds 1 NaN", device="cpu"))
    assert same_failure(captured, Failure(
        "RuntimeError", "Function 'SqrtBackward0' returned nan values in its 0th output.",
        device="cpu"))
    assert not same_failure(captured, Failure(
        "RuntimeError", "mat1 and mat2 shapes cannot be multiplied (2x3 and 4x5)",
        device="cpu"))


def test_an_output_holding_inf_alone_is_non_finite_not_nan() -> None:
    """inf and no NaN: the class a user reads in case.toml and in the xfail text is
    "nonfinite", never "nan"; NaN and inf are the same failure, whichever was held."""
    inf = Failure("FloatingPointError", "non-finite output of Net: out holds 3 inf",
                  device="cpu")
    assert inf.kind == "nonfinite"
    assert same_failure(inf, Failure("FloatingPointError",
                                     "non-finite output: out holds 1 NaN", device="cpu"))


def test_a_case_written_with_the_former_nan_class_means_the_same() -> None:
    """Cases on disk written before the class was named nonfinite hold "nan": read as
    nonfinite, they are met by the same replays as a new case."""
    old = Failure.from_text("FloatingPointError: non-finite loss of f: out holds 2 inf",
                            device="cpu", failure_class="nan")
    new = Failure.from_text("FloatingPointError: non-finite loss of f: out holds 2 inf",
                            device="cpu", failure_class="nonfinite")
    assert old == new and old.kind == "nonfinite"
    found = Failure("RuntimeError", "Function 'LogBackward0' returned nan values in its 0th "
                    "output.", device="cpu")
    assert same_failure(old, found) and same_failure(new, found)
    assert same_class("nan", "nonfinite") and same_class("nonfinite", "nan")


INPLACE = ("one of the variables needed for gradient computation has been modified by an "
           "inplace operation: [torch.FloatTensor [2, 4]], which is output 0 of Sigmoid, is at "
           "version 1; expected version 0 instead. Hint: enable anomaly detection to find the "
           "operation that failed to compute its gradient, with "
           "torch.autograd.set_detect_anomaly(True, check_nan=False).")


@pytest.mark.parametrize("limit", [256, 300, 120, 97, 95])
def test_a_message_the_capture_cut_matches_its_full_form(limit: int) -> None:
    """Issue 30: ``[origin] error`` cut at a bound with an ellipsis (anywhere: inside a word,
    inside a number, inside a list of sizes) is the replay's full message again."""
    from pytest_gpucase.verdict.failure import cut

    recorded = Failure.from_text(cut(f"RuntimeError: {INPLACE}", limit))
    assert recorded.message.endswith("\u2026")
    assert same_failure(recorded, Failure("RuntimeError", INPLACE, device="cpu"))
    # Another failure is still another, cut or not.
    other = INPLACE.replace("gradient computation", "the forward pass")
    assert not same_failure(recorded, Failure("RuntimeError", other))
    assert not same_failure(recorded, Failure("ValueError", INPLACE))


def test_too_little_kept_of_a_cut_message_matches_nothing_else() -> None:
    from pytest_gpucase.verdict.failure import cut

    recorded = Failure.from_text(cut(f"RuntimeError: {INPLACE}", 30))
    assert not same_failure(recorded, Failure("RuntimeError", INPLACE))
    assert same_failure(recorded, recorded)


def test_a_message_the_capture_scrubbed_is_the_raw_failure() -> None:
    """Issue 30: the Recorder writes [origin] error without secrets (URL credentials, tokens,
    the home as ~); the replay raises the raw message, which is the same failure."""
    import os

    from pytest_gpucase.tools.scrub import capture_text

    home = os.path.expanduser("~")
    raw = (f"cannot reach postgres://alice:pw@db.example.com:5432/prod with token "
           f"ghp_a1B2c3D4e5F6g7H8i9J0k1L2m3N4o5P6q7R8 reading {home}/data/shards: refused")
    written = capture_text(raw)
    assert "alice:pw" not in written and "ghp_" not in written
    assert same_failure(Failure("ConnectionError", written), Failure("ConnectionError", raw))
    assert not same_failure(Failure("ConnectionError", written),
                            Failure("ConnectionError", raw.replace("refused", "timed out")))
