"""Turn the text of a failure into the first thing to check and the conclusion to avoid."""

from __future__ import annotations

import re
from dataclasses import dataclass

from pytest_gpucase.base.backends import asserts_note, backend_of_text, launch_blocking_words, title

__all__ = ["FAILURE_CLASSES", "LOADER_CLASSES", "NONFINITE", "SCANNED", "Triage",
           "assertion_line", "bounded", "current_class", "failure_class", "loader_words",
           "same_failure", "triage"]

# The class of a NaN or an inf no op raised (a guard's, a finiteness check's, anomaly mode's):
# "non-finite", never "NaN", since an output may hold inf and no NaN at all.
NONFINITE = "nonfinite"
# Class names that cases written by an earlier gpucase hold ([origin] failure_class), read as
# the class they became: "nan" named every non-finite failure, inf alone included.
_FORMER_CLASSES = {"nan": NONFINITE}

_RESTART = (
    "the process must be restarted before any reproduction: the device context is unusable "
    "after this error"
)
_CPU_HINT = (
    "Replaying the same inputs on CPU usually turns this into a readable error "
    "(e.g. 'Target 4 is out of bounds.'); a CPU pass is a hint, not CUDA validation."
)

@dataclass(frozen=True)
class Triage:
    """The first check for one failure, as read from its exception and captured stderr."""

    clue: str
    first_check: str
    avoid: str
    asynchronous: bool
    sticky: bool
    backend: str | None
    notes: tuple[str, ...] = ()

    def render(self) -> str:
        """Return the body of the "gpucase triage" report section, one fact a line."""
        backend = f" ({title(self.backend)})" if self.backend else ""
        lines = [
            f"clue: {self.clue}{backend}",
            f"first check: {self.first_check}",
            f"avoid: {self.avoid}",
        ]
        if self.asynchronous:
            rerun = launch_blocking_words(self.backend)
            lines.append(
                "asynchronous: reported at a later call, so the traceback may point past the "
                f"cause; rerun with {rerun} to stop at the failing kernel"
            )
        if self.sticky:
            lines.append(f"restart: {_RESTART}")
        lines.extend(f"note: {note}" for note in self.notes)
        return "\n".join(lines)

    def to_dict(self) -> dict[str, object]:
        """Return the triage as plain JSON-ready data."""
        return {
            "clue": self.clue,
            "first_check": self.first_check,
            "avoid": self.avoid,
            "asynchronous": self.asynchronous,
            "sticky": self.sticky,
            "backend": self.backend,
            "notes": list(self.notes),
        }


# What ``run.child`` adds to a loader error's text: the torch of the run, and the one the
# build of the failing package says it was made for (``plan.environment.package_build``).
_LOADER_DETAILS: tuple[tuple[str, str], ...] = (
    (r"\(torch (?P<here>[0-9][^\s;,)]{0,40}) here, (?P<package>[^\s;,)]{1,256}) "
     r"(?P<version>[^\s;,)]{1,64}) built for torch (?P<built>[0-9][^\s;,)]{0,40})\)",
     "rebuild {package} {version} against torch {here}, the torch it runs with here (it was "
     "built for torch {built})"),
    (r"\(torch (?P<here>[0-9][^\s;,)]{0,40}) here(?:, (?P<package>[^\s;,)]{1,256}) "
     r"(?P<version>[^\s;,)]{1,64}))?\)\Z",
     "rebuild the extension against torch {here}, the torch it runs with here"),
)


@dataclass(frozen=True)
class _Rule:
    """One row of the triage table: the texts that identify a clue, and what to say about it."""

    clue: str
    kind: str  # the failure class (FAILURE_CLASSES): what a replay elsewhere must raise again
    first_check: str
    avoid: str
    # Searched in the exception message; in stderr only when no rule matched the message,
    # because a child that aborts prints its C++ error there ("what():  CUDA error: ...").
    patterns: tuple[str, ...]
    # Searched in stderr with the same priority as the message: conclusive on their own
    # (the kernel's assertion line explains a later cuBLAS failure, not the reverse).
    stderr_patterns: tuple[str, ...] = ()
    # Exception type names (the last dotted part) that identify the clue with no text at all.
    error_types: tuple[str, ...] = ()
    asynchronous: bool = False
    sticky: bool = False
    notes: tuple[str, ...] = ()
    # A kernel assert would catch it: the backend's note on kernel asserts applies.
    kernel_asserts: bool = False
    # (regex with named groups, note template): a note for each one found in the message.
    details: tuple[tuple[str, str], ...] = ()
    # Quote the kernel's assertion line from stderr and say what its condition means.
    reads_assertion: bool = False


# Order is priority: the first row whose pattern matches wins, so root causes that make
# later calls fail (asserts, illegal accesses) come before what they cause.
_RULES: tuple[_Rule, ...] = (
    _Rule(
        clue="device-side assert",
        kind="device-side-assert",
        first_check=(
            "Check the indices, targets and operator conditions that reached the kernel: class "
            "targets in [0, num_classes) or ignore_index, embedding/gather/index_select indices "
            "below the size of the indexed dimension, probabilities in [0, 1]."
        ),
        avoid=(
            "Do not conclude the GPU is broken: a device-side assert is an input check that "
            "failed inside a kernel."
        ),
        patterns=(
            r"device-side assert triggered",
            r"device-side assertion failures were found",
            r"cuda runtime error \(59\)",
            r"\b(cuda|hip)ErrorAssert\b",
        ),
        stderr_patterns=(r"Assertion `[^`]{0,1024}` failed",
                         r"Device-side assertion `[^']{0,1024}' failed"),
        asynchronous=True,
        sticky=True,
        notes=(_CPU_HINT,),
        kernel_asserts=True,
        reads_assertion=True,
    ),
    _Rule(
        clue="illegal memory access",
        kind="illegal-address",
        first_check=(
            "Rerun with launch blocking to name the kernel, then check what it was given: an "
            "unchecked out-of-range index or size, a custom or extension kernel, or a tensor "
            "freed or resized while a kernel on another stream still used it."
        ),
        avoid=(
            "Do not blame the hardware or the amount of memory: an illegal access is a wrong "
            "address computed by a kernel, not a lack of memory."
        ),
        patterns=(
            r"an illegal memory access was encountered",
            r"\bmisaligned address\b",
            r"\b(cuda|hip)ErrorIllegalAddress\b",
            r"\bcudaErrorMisalignedAddress\b",
        ),
        stderr_patterns=(r"Memory access fault by GPU node",),
        asynchronous=True,
        sticky=True,
        kernel_asserts=True,
    ),
    _Rule(
        clue="launch failure",
        kind="launch-failure",
        first_check=(
            "Rerun with launch blocking to name the kernel; check custom or extension kernels, "
            "inputs beyond the kernel's limits, and the system log (dmesg, Xid) for a driver "
            "reset or a watchdog timeout."
        ),
        avoid=(
            "Do not retry in the same process and count it as passing: the context is lost, "
            "and a failure that comes and goes still has a cause."
        ),
        patterns=(
            r"unspecified launch failure",
            r"an illegal instruction was encountered",
            r"the launch timed out and was terminated",
            r"\b(cuda|hip)ErrorLaunchFailure\b",
            r"\bcudaErrorIllegalInstruction\b",
            r"\b(cuda|hip)ErrorLaunchTimeOut\b",
        ),
        asynchronous=True,
        sticky=True,
    ),
    _Rule(
        clue="uncorrectable ECC error",
        kind="ecc",
        first_check=(
            "Check the device's ECC counters and the system log (nvidia-smi -q -d ECC, dmesg "
            "Xid), and rerun the case on another device."
        ),
        avoid="Do not change the code to work around it: this is a fault of the device or node.",
        patterns=(
            r"uncorrectable ECC error encountered",
            r"\bcudaErrorECCUncorrectable\b",
            r"GPU has fallen off the bus",
        ),
        sticky=True,
    ),
    _Rule(
        clue="out of memory",
        kind="oom",
        first_check=(
            "Check the shapes and batch size at the failing step, tensors kept alive across "
            "steps (losses held with their graphs, caches, lists of outputs), and memory held "
            "by other processes on the same device."
        ),
        avoid=(
            "Do not read every CUDA error as low VRAM: only an out-of-memory message means "
            "memory ran out, and a larger GPU does not fix a leak."
        ),
        patterns=(
            r"\b(CUDA|HIP|XPU) out of memory",
            r"\bMPS backend out of memory",
            r"\b(CUDA|HIP)( driver)? error: out of memory",
            r"cuda runtime error \(2\) : out of memory",
            r"\b(cudaErrorMemoryAllocation|hipErrorOutOfMemory)\b",
            r"\b(CUBLAS|HIPBLAS)_STATUS_ALLOC_FAILED\b",
            r"DefaultCPUAllocator: (can't allocate memory|not enough memory)",
        ),
        error_types=("OutOfMemoryError",),
    ),
    _Rule(
        clue="no usable device",
        kind="no-device",
        first_check=(
            "Check what this process sees: the torch build (torch.version.cuda or "
            "torch.version.hip; a CPU-only wheel has neither), the driver against that build "
            "(nvidia-smi, rocm-smi), and CUDA_VISIBLE_DEVICES or HIP_VISIBLE_DEVICES."
        ),
        avoid="Do not debug the model or the case: nothing reached a device.",
        patterns=(
            r"Torch not compiled with \w+ enabled",
            r"Found no NVIDIA driver on your system",
            r"The NVIDIA driver on your system is too old",
            r"CUDA driver version is insufficient for CUDA runtime version",
            r"no CUDA-capable device is detected",
            r"No (CUDA|HIP) GPUs are available",
            r"all CUDA-capable devices are busy or unavailable",
            r"\bhipErrorNoDevice\b",
        ),
    ),
    _Rule(
        clue="invalid device ordinal",
        kind="invalid-device",
        first_check=(
            "Check the device index against torch.cuda.device_count() in the environment that "
            "ran it: the index counts only the devices CUDA_VISIBLE_DEVICES or "
            "HIP_VISIBLE_DEVICES leaves visible."
        ),
        avoid="Do not hard-code cuda:N from the machine where the failure was recorded.",
        patterns=(r"invalid device ordinal", r"\b(cuda|hip)ErrorInvalidDevice\b"),
    ),
    _Rule(
        clue="no kernel image",
        kind="no-kernel-image",
        first_check=(
            "Check that torch and every extension were built for this GPU: compare "
            "torch.cuda.get_arch_list() with torch.cuda.get_device_capability() (ROCm: the gfx "
            "target), and the extension's TORCH_CUDA_ARCH_LIST or PYTORCH_ROCM_ARCH."
        ),
        avoid=(
            "Do not reinstall everything or downgrade the driver: install or build the one "
            "package whose architecture list lacks this GPU."
        ),
        patterns=(
            r"no kernel image is available for execution on the device",
            r"\bcudaErrorNoKernelImageForDevice\b",
            r"invalid device function",
            r"\bhipErrorNoBinaryForGpu\b",
            r"is not compatible with the current PyTorch installation",
        ),
        stderr_patterns=(r"hipErrorNoBinaryForGpu: Unable to find code object",),
    ),
    # The loader's refusals: the case is fine, one package's build does not match this
    # process (torch, CUDA, the C++ runtime). ``run.child`` tells an import failing this way
    # apart from a broken case by these rows (``loader_error``), and adds the torch of the
    # run ("torch 2.13.0 here") and the one the build says it was made for, which the notes
    # below quote.
    _Rule(
        clue="extension built for another torch or CUDA",
        kind="abi-mismatch",
        first_check=(
            "Compare the torch and CUDA the extension was built against with the ones it is "
            "loaded into (pip show on it; torch.__version__ and torch.version.cuda here): an "
            "undefined symbol of torch's C++ API (c10::, at::, torch::) means a build for "
            "another torch release. Rebuild it against this torch (pip install "
            "--no-build-isolation, so that the build sees it), or install its wheel made for "
            "this torch and CUDA."
        ),
        avoid=(
            "Do not call the case broken or reinstall everything: the case is fine, and one "
            "package's build does not match this torch; rebuild or reinstall that one."
        ),
        patterns=(
            r"undefined symbol: \S{1,1024}",
            r"symbol not found in flat namespace",
            r"Symbol not found: \S{1,1024}",
            r"DLL load failed while importing \w{1,256}: The specified procedure could not be "
            r"found",
        ),
        details=(
            *_LOADER_DETAILS,
            (r"(?P<lib>[^\s:'\"]{1,512}): undefined symbol: (?P<symbol>[^\s,]{1,512})",
             "{lib} needs {symbol}, which no library loaded here defines"),
            (r"undefined symbol: (?P<symbol>_ZN[KRVO]{0,3}(?:3c10|2at|5torch|6caffe2)"
             r"[^\s,]{0,512})",
             "{symbol} is torch's own C++ API: the extension was built against another torch"),
            (r"undefined symbol: (?P<symbol>(?:cuda|cublas|cudnn|nccl|cusparse|cufft|curand|nvrtc)"
             r"\w{0,256})",
             "{symbol} is CUDA's: the extension expects another CUDA runtime than the one "
             "loaded here"),
        ),
    ),
    _Rule(
        clue="shared library not found",
        kind="library-missing",
        first_check=(
            "Find which library the loader could not open and what provides it: a CUDA "
            "library (libcudart.so.12, libcublas.so.12) names the CUDA major version the "
            "extension was built for; libtorch or libc10 means torch was not imported first "
            "or is another build. ldd on the extension's .so file lists what it needs; pip list "
            "shows the nvidia-* packages installed."
        ),
        avoid=(
            "Do not point LD_LIBRARY_PATH at whatever toolkit the machine has or copy .so files "
            "into place: install the extension's build for this torch and CUDA, or the package "
            "that provides the library."
        ),
        patterns=(
            r"cannot open shared object file",
            r"Library not loaded: \S{1,1024}",
            r"DLL load failed while importing \w{1,256}: The specified module could not be "
            r"found",
        ),
        details=(
            (r"(?P<lib>[^\s:'\"]{1,512}): cannot open shared object file",
             "the loader could not find {lib}"),
            (r"(?P<lib>lib(?:cudart|cublas|cublasLt|nvrtc|cusparse|cufft|curand)\.so\."
             r"(?P<major>[0-9]{1,3}))\b",
             "{lib}: the extension was built for CUDA {major}"),
        ),
    ),
    _Rule(
        clue="C++ runtime too old",
        kind="runtime-too-old",
        first_check=(
            "Check which libstdc++ (or glibc) the process loads against the one the extension "
            "was built with: a conda environment or an old system library shadows the newer "
            "one the build needs (LD_LIBRARY_PATH, the libstdc++ of the environment; strings "
            "on it | grep GLIBCXX lists what it provides)."
        ),
        avoid=(
            "Do not rebuild torch or change the case: make the process load a C++ runtime at "
            "least as new as the extension's build needs, or build the extension with this "
            "environment's own toolchain."
        ),
        patterns=(r"version `(?:GLIBCXX|CXXABI|GLIBC)_[0-9.]{1,32}' not found",),
        details=(
            (r"version `(?P<version>(?:GLIBCXX|CXXABI|GLIBC)_[0-9.]{1,32})' not found "
             r"\(required by (?P<lib>[^)]{1,512})\)",
             "{lib} needs {version}, which the C++ runtime loaded here lacks"),
        ),
    ),
    _Rule(
        clue="different devices",
        kind="device-mismatch",
        first_check=(
            "Check the placement of the model and of every input: where each tensor is "
            "created or loaded, and which ones a .to(device) missed (buffers, targets, masks, "
            "tensors built inside forward)."
        ),
        avoid=(
            "Do not add .to() copies at the failing line without knowing where the tensors "
            "come from: the copy hides the placement mistake and costs a transfer every step."
        ),
        patterns=(
            r"Expected all tensors to be on the same (common )?device",
            r"Expected object of device type \w+ but got device type \w+",
            r"is on (CPU|GPU), but expected (it|them) to be on (CPU|GPU)",
            r"indices should be either on cpu or on the same device as the indexed tensor",
            r"Tensor on device \S{1,256} is not on the expected device \S{1,256}",
            r"Input type \(torch\.\w+\) and weight type \(torch\.cuda\.\w+\)",
            r"Input type \(torch\.cuda\.\w+\) and weight type \(torch\.\w+\)",
            r"Placeholder storage has not been allocated on MPS device",
            r"Unhandled FakeTensor Device Propagation for \S{1,256}, found two different devices",
        ),
        details=(
            (
                r"found at least two devices, (?P<a>[\w:]{1,64}) and (?P<b>[\w:]{1,64})",
                "devices involved: {a} and {b}",
            ),
            (
                (
                    r"but got (?P<arg>\w{1,256}) is on (?P<a>[\w:]{1,64}), different from other "
                    r"tensors on (?P<b>[\w:]{1,64})"
                ),
                "argument {arg} is on {a}; the other tensors are on {b}",
            ),
        ),
    ),
    _Rule(
        clue="operator not available",
        kind="operator-missing",
        first_check=(
            "Check the versions (torch, and each extension built against that torch), whether "
            "the extension was built for this backend, the device the inputs are on, and their "
            "dtype."
        ),
        avoid=(
            "Do not reinstall everything: find which of version, extension build, backend or "
            "dtype lacks the kernel, and fix that one."
        ),
        patterns=(
            r"Could not run '[^']{1,512}' with arguments from the '[^']{1,512}' backend",
            r"is not currently implemented for the MPS device",
            r"operator \S{1,512} does not exist",
            r"No operator found for `\w+`",
            r"'_OpNamespace' '[^']{1,256}' object has no attribute '[^']{1,256}'",
            r"No such operator \S{1,512}",
        ),
        details=(
            (
                (
                    r"Could not run '(?P<op>[^']{1,512})' with arguments from the "
                    r"'(?P<key>[^']{1,512})' backend"
                ),
                "{op} has no kernel for the {key} dispatch key in this build",
            ),
            (
                (r"'_OpNamespace' '(?P<ns>[^']{1,256})' object has no attribute "
                 r"'(?P<op>[^']{1,256})'"),
                (
                    "torch.ops.{ns} has no {op}: the extension that registers it was not "
                    "imported, did not load, or is a version or build without it"
                ),
            ),
            (
                r"operator (?P<op>\S{1,512}) does not exist",
                (
                    "{op} is not registered: the extension that defines it did not load or was "
                    "built for another torch version"
                ),
            ),
        ),
    ),
    _Rule(
        clue="dtype not implemented",
        kind="dtype-not-implemented",
        first_check=(
            "Check the dtype of every input to that operator: a kernel missing for Half or "
            "BFloat16 on this backend and version, or an input of the wrong kind (class targets "
            "must be int64)."
        ),
        avoid=(
            "Do not cast the whole model or move it to another device to make it pass without "
            "knowing which input has the unsupported dtype."
        ),
        patterns=(r"\"\w+\" not implemented for '\w+'", r"Low precision dtypes not supported"),
        details=(
            (
                r"\"(?P<kernel>\w+)\" not implemented for '(?P<dtype>\w+)'",
                "kernel {kernel} has no {dtype} version",
            ),
            (
                r"\"nll_loss\w*\" not implemented for '(?P<dtype>\w+)'",
                (
                    "the class targets are {dtype}: cross_entropy and nll_loss take int64 (long) "
                    "class indices"
                ),
            ),
        ),
    ),
    _Rule(
        clue="dtype mismatch",
        kind="dtype-mismatch",
        first_check=(
            "Check where each operand's dtype comes from: autocast regions, .half() or .to() "
            "on part of the model, float64 arrays from NumPy, targets that are not int64."
        ),
        avoid=(
            "Do not scatter .float() casts until it runs: find the tensor whose dtype differs "
            "and fix it where it is made."
        ),
        patterns=(
            r"expected scalar type \w+ but found \w+",
            r"expected (m1|mat1) and (m2|mat2) to have the same dtype",
            r"mat1 and mat2 must have the same dtype",
            (
                r"Input type \([^)]{0,256}\) and (weight|bias) type \([^)]{0,256}\) should be "
                r"the same"
            ),
            r"expected target dtype to be Long",
            r"Expected tensor for argument #\d+ '\w+' to have (one of the following )?scalar type",
        ),
    ),
    _Rule(
        clue="cuDNN/cuBLAS error",
        kind="library-error",
        first_check=(
            "Rerun with launch blocking to see whether an earlier kernel failed first (a "
            "library status is often the first report of an earlier error), then check the "
            "operands' shapes, strides and dtypes, and memory headroom (NOT_INITIALIZED often "
            "means memory ran out)."
        ),
        avoid=(
            "Do not disable cuDNN or reinstall the library before knowing which call failed "
            "with which operands."
        ),
        patterns=(
            r"\b(CUBLAS|CUBLASLT|HIPBLAS|HIPBLASLT)_STATUS_\w+",
            r"\bCUDNN_STATUS_\w+",
            r"\bCUSOLVER_STATUS_\w+",
            r"\bMIOpen Error\b",
            r"\bmiopenStatus\w+",
            r"\brocblas_status_\w+",
        ),
    ),
    _Rule(
        clue="index out of range (CPU)",
        kind="index-out-of-range",
        first_check=(
            "Check the indices and targets against the size they index: class targets in "
            "[0, num_classes) or ignore_index, token ids below num_embeddings, gather and "
            "index values below the dimension size."
        ),
        avoid=(
            "Do not clamp the indices or enlarge the layer to make it pass: find where the "
            "out-of-range value was made (label mapping, tokenizer against vocabulary, "
            "padding value)."
        ),
        patterns=(
            r"Target -?\d+ is out of bounds",
            r"index out of range in self",
            r"index -?\d+ is out of bounds for dimension \d+ with size \d+",
            r"Class values must be (smaller than num_classes|non-negative)",
        ),
        notes=(
            (
                "On CUDA the same inputs raise a device-side assert that ends the process; "
                "pytest_gpucase.checks.class_indices and index_within catch them before the kernel."
            ),
        ),
        details=(
            (
                r"Target (?P<value>-?\d+) is out of bounds",
                (
                    "a class target is {value}: targets must lie in [0, num_classes) or equal "
                    "ignore_index"
                ),
            ),
            (
                r"index out of range in self",
                (
                    "an embedding or index_select index is negative or at least the size of the "
                    "indexed dimension (nn.Embedding: num_embeddings)"
                ),
            ),
        ),
    ),
    _Rule(
        clue="value out of range (CPU)",
        kind="value-out-of-range",
        first_check=(
            "Check the values fed to the loss: binary_cross_entropy takes probabilities in "
            "[0, 1] (pass logits to binary_cross_entropy_with_logits), and NaN fails the check "
            "too."
        ),
        avoid="Do not clamp the input to silence the check before knowing how it left [0, 1].",
        patterns=(r"all elements of input should be between 0 and 1",),
    ),
    _Rule(
        clue="NaN/inf",
        kind=NONFINITE,
        first_check=(
            "Find the first step and tensor where a NaN or inf appears: the inputs, the loss, "
            "then the gradients (torch.autograd.set_detect_anomaly); look at the learning rate, "
            "log, sqrt or division near zero, and float16 overflow (max 65504)."
        ),
        avoid=(
            "Do not clip, clamp or skip the step to hide it before finding where the first "
            "non-finite value comes from."
        ),
        patterns=(
            r"returned nan values in its \w+ output",
            r"is non-finite, so it cannot be clipped",
            r"probability tensor contains either `inf`, `nan` or element < 0",
            r"to satisfy the constraint .{0,1024}, but found invalid values",
            # The Recorder's nonfinite= and its replays, and checks.finite.
            r"\bnon-finite (?:value|output|loss|gradient)",
            r"\bholds \d+ (?:NaN|inf)\b",
            r"\bis [-+]?(?:nan|inf)$",
        ),
        error_types=("FloatingPointError",),
        details=(
            (
                r"Function '(?P<function>\w+)' returned nan values",
                "anomaly mode names {function} as the first backward function to return NaN",
            ),
        ),
    ),
)

_ASSERTION = re.compile(
    r"Assertion `[^`]{0,1024}` failed|Device-side assertion `[^']{0,1024}' failed"
)

# What a kernel's assertion condition means, in the user's words.
_ASSERTION_MEANINGS: tuple[tuple[str, str], ...] = (
    (
        r"t >= 0 && t < n_classes",
        (
            "a class target is outside [0, num_classes) and not ignore_index (nll_loss, "
            "cross_entropy)"
        ),
    ),
    (
        r"srcIndex < srcSelectDimSize",
        (
            "an index_select or embedding index is at least the size of the indexed dimension "
            "(nn.Embedding: a token id >= num_embeddings)"
        ),
    ),
    (
        r"input_val >= zero && input_val <= one",
        (
            "binary_cross_entropy got an input outside [0, 1]: pass logits to "
            "binary_cross_entropy_with_logits, or look for NaN before the sigmoid"
        ),
    ),
    (
        r"index out of bounds",
        (
            "an index is outside the dimension it indexes (indexing, gather, scatter, or a "
            "torch.compile kernel)"
        ),
    ),
)

@dataclass(frozen=True)
class _CompiledRule:
    rule: _Rule
    message: re.Pattern[str] | None
    stderr: re.Pattern[str] | None
    details: tuple[tuple[re.Pattern[str], str], ...]


def _either(patterns: tuple[str, ...]) -> re.Pattern[str] | None:
    return re.compile("|".join(f"(?:{p})" for p in patterns), re.IGNORECASE) if patterns else None


_COMPILED: tuple[_CompiledRule, ...] = tuple(
    _CompiledRule(
        rule=rule,
        message=_either(rule.patterns),
        stderr=_either(rule.stderr_patterns),
        details=tuple((re.compile(p, re.IGNORECASE), text) for p, text in rule.details),
    )
    for rule in _RULES
)
_COMPILED_MEANINGS = tuple((re.compile(p), text) for p, text in _ASSERTION_MEANINGS)

# The class of a kernel assertion, by its condition: the check the CPU kernel makes too.
_ASSERTION_CLASSES: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"t >= 0 && t < n_classes|srcIndex < srcSelectDimSize|index out of bounds|"
                r"idx_dim >= 0 && idx_dim < index_size"), "index-out-of-range"),
    (re.compile(r"input_val >= zero && input_val <= one"), "value-out-of-range"),
)

# Every class failure_class can return, in rule order.
FAILURE_CLASSES: tuple[str, ...] = tuple(dict.fromkeys(rule.kind for rule in _RULES))

# A device-side assert is an input check made inside a kernel: on the CPU the same check
# raises a readable error, so a class it was captured as is met by these classes elsewhere.
# Read as: a case captured as the key reproduces when a replay raises any of the values.
_EQUIVALENT: dict[str, frozenset[str]] = {
    "device-side-assert": frozenset({"device-side-assert", "index-out-of-range",
                                     "value-out-of-range"}),
    "index-out-of-range": frozenset({"index-out-of-range", "device-side-assert"}),
    "value-out-of-range": frozenset({"value-out-of-range", "device-side-assert"}),
}


# A child may print megabytes; its error is at the start or the end of what it printed. Only
# that much is read, and every pattern above has bounded repeats next to its literals, so
# that triage costs time linear in a bounded text, whatever the child wrote.
SCANNED = 64 * 1024


def bounded(text: str, limit: int = SCANNED) -> str:
    """``text`` if it is short, else its first and last ``limit`` characters around a mark."""
    if len(text) <= 2 * limit:
        return text
    return f"{text[:limit]}\n[... {len(text) - 2 * limit} characters not read ...]\n" \
           f"{text[-limit:]}"


def assertion_line(stderr: str) -> str | None:
    """Return the first kernel assertion line in captured stderr, or None when there is none."""
    for line in bounded(stderr).splitlines():
        if _ASSERTION.search(line):
            return line.strip()
    return None


def triage(error_type: str, message: str, stderr: str = "") -> Triage | None:
    """Return the triage for a failure's exception type, message and stderr, or None."""
    short_type = error_type.rsplit(".", 1)[-1]
    message, stderr = bounded(message), bounded(stderr)
    found = _match(short_type, message, stderr)
    if found is None:
        return None
    rule = found.rule
    backend = backend_of_text(f"{message}\n{stderr}")
    notes: list[str] = []
    for pattern, text in found.details:
        hit = pattern.search(message) or pattern.search(stderr)
        if hit:
            notes.append(text.format(**hit.groupdict()))
    if rule.reads_assertion:
        notes.extend(_assertion_notes(stderr))
    notes.extend(rule.notes)
    note = asserts_note(backend) if rule.kernel_asserts else None
    if note is not None:
        notes.append(note)
    return Triage(
        clue=rule.clue,
        first_check=rule.first_check,
        avoid=rule.avoid,
        asynchronous=rule.asynchronous,
        sticky=rule.sticky,
        backend=backend,
        notes=tuple(notes),
    )


def failure_class(error_type: str, message: str, stderr: str = "") -> str | None:
    """The failure class of an exception (one of ``FAILURE_CLASSES``), or None when unknown.

    A device-side assert whose kernel assertion line is in ``stderr`` takes the class of the
    check that failed ("index-out-of-range" for an embedding or nll_loss index), the class
    the CPU raises for the same inputs; without the line it stays "device-side-assert".
    """
    short_type = error_type.rsplit(".", 1)[-1]
    message, stderr = bounded(message), bounded(stderr)
    found = _match(short_type, message, stderr)
    if found is None:
        return None
    if found.rule.reads_assertion:
        line = assertion_line(stderr) or assertion_line(message)
        for pattern, kind in _ASSERTION_CLASSES:
            if line is not None and pattern.search(line):
                return kind
    return found.rule.kind


# The classes of a loader's refusal: the package's build does not fit this process.
LOADER_CLASSES = ("abi-mismatch", "library-missing", "runtime-too-old")
_LOADER = tuple(compiled for compiled in _COMPILED if compiled.rule.kind in LOADER_CLASSES)
_LOADER_SHOWN = 400   # characters of the loader's line said in a one-line message


def loader_words(message: str) -> str | None:
    """The line of ``message`` in which the dynamic loader refused a library (an undefined
    symbol, a library it cannot open, a C++ runtime too old), in its own words; None for
    any other failure. What tells an import that failed for the environment from a case
    that is wrong."""
    message = bounded(message)
    for compiled in _LOADER:
        assert compiled.message is not None
        found = compiled.message.search(message)
        if found is not None:
            start = message.rfind("\n", 0, found.start()) + 1
            end = message.find("\n", found.end())
            line = message[start:end if end >= 0 else len(message)].strip()
            return line if len(line) <= _LOADER_SHOWN else line[:_LOADER_SHOWN - 1] + "…"
    return None


def current_class(name: str) -> str:
    """The failure class ``name`` means now: a name an earlier gpucase wrote into
    ``[origin] failure_class`` (``nan``) is read as the class it became (``nonfinite``)."""
    return _FORMER_CLASSES.get(name, name)


def same_failure(recorded: str, found: str | None) -> bool:
    """Whether a failure of class ``found`` reproduces one recorded as class ``recorded``
    (the equivalences are the table "Failure classes" in docs/case-format.md); a former
    class name means the class it became."""
    if found is None:
        return False
    recorded, found = current_class(recorded), current_class(found)
    return found in _EQUIVALENT.get(recorded, frozenset({recorded}))


def _match(short_type: str, message: str, stderr: str) -> _CompiledRule | None:
    for compiled in _COMPILED:
        if short_type in compiled.rule.error_types:
            return compiled
        if compiled.message is not None and compiled.message.search(message):
            return compiled
        if compiled.stderr is not None and compiled.stderr.search(stderr):
            return compiled
    # A child that aborted may leave an empty message and its error text on stderr only.
    for compiled in _COMPILED:
        if compiled.message is not None and compiled.message.search(stderr):
            return compiled
    return None


def _assertion_notes(stderr: str) -> list[str]:
    line = assertion_line(stderr)
    if line is None:
        return []
    notes = [f"kernel assertion: {line}"]
    for pattern, meaning in _COMPILED_MEANINGS:
        if pattern.search(line):
            notes.append(f"meaning: {meaning}")
            break
    return notes
