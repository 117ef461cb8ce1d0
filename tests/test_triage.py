"""Triage of real failure texts from PyTorch releases, CUDA and ROCm builds, old and new."""

from __future__ import annotations

from typing import Any

import pytest

from pytest_gpucase.verdict.triage import Triage, assertion_line, triage

# The tail PyTorch 1.13-2.7 appends to every CUDA error (c10/cuda/CUDAException.cpp).
_CUDA_TAIL = (
    "\nCUDA kernel errors might be asynchronously reported at some other API call, so the "
    "stacktrace below might be incorrect.\nFor debugging consider passing CUDA_LAUNCH_BLOCKING=1"
    "\nCompile with `TORCH_USE_CUDA_DSA` to enable device-side assertions.\n"
)
# The HIP spelling of the same tail (ROCm 6 wheels, from a ComfyUI report).
_HIP_TAIL = (
    "\nHIP kernel errors might be asynchronously reported at some other API call, so the "
    "stacktrace below might be incorrect.\nFor debugging consider passing AMD_SERIALIZE_KERNEL=3"
    "\nCompile with `TORCH_USE_HIP_DSA` to enable device-side assertions.\n"
)


def _newest(error: str, name: str, asynchronous: bool) -> str:
    """Build a PyTorch 2.8+ message the way c10_cuda_check_implementation assembles it."""
    help_line = (
        f"\nSearch for `{name}' in https://docs.nvidia.com/cuda/cuda-runtime-api/"
        "group__CUDART__TYPES.html for more information."
    )
    suffix = (
        "\nCUDA kernel errors might be asynchronously reported at some other API call, so the "
        "stacktrace below might be incorrect.\nFor debugging consider passing CUDA_LAUNCH_BLOCKING=1"
        if asynchronous
        else "\nFor more detailed error information, run with CUDA_LOG_FILE=stderr"
    )
    return (
        f"CUDA error: {error}{help_line}{suffix}\n"
        "Compile with `TORCH_USE_CUDA_DSA` to enable device-side assertions.\n"
    )


_LOSS_CU = (
    "/opt/conda/conda-bld/pytorch_1678411187366/work/aten/src/ATen/native/cuda/Loss.cu:240: "
    "nll_loss_forward_reduce_cuda_kernel_2d: block: [0,0,0], thread: [{t},0,0] "
    "Assertion `t >= 0 && t < n_classes` failed.\n"
)
_LOSS_STDERR = _LOSS_CU.format(t=0) + _LOSS_CU.format(t=1)

# (id, error type, message, stderr, clue, backend); where each text was found is noted above it.
CASES = [
    # c10/cuda/CUDAException.cpp before 2.8; assertion line from a user's log of torch 2.0.
    pytest.param(
        "RuntimeError",
        "CUDA error: device-side assert triggered" + _CUDA_TAIL,
        _LOSS_STDERR,
        "device-side assert",
        "cuda",
        id="assert-cuda-2.0",
    ),
    # c10/cuda/CUDAException.cpp + CUDAMiscFunctions.cpp at main: AcceleratorError, "Search for".
    pytest.param(
        "torch.AcceleratorError",
        _newest("device-side assert triggered", "cudaErrorAssert", asynchronous=True),
        "",
        "device-side assert",
        "cuda",
        id="assert-cuda-2.8",
    ),
    # Pre-1.5 THC format, with the ClassNLLCriterion.cu assertion (user reports).
    pytest.param(
        "RuntimeError",
        "cuda runtime error (59) : device-side assert triggered at "
        "/pytorch/aten/src/THC/THCCachingHostAllocator.cpp:296",
        "/pytorch/torch/lib/THCUNN/ClassNLLCriterion.cu:101: void "
        "cunn_ClassNLLCriterion_updateOutput_kernel(Dtype *, Dtype *, Dtype *, long *, Dtype *, "
        "int, int, int, int, long) [with Dtype = float, Acctype = float]: block: [0,0,0], "
        "thread: [23,0,0] Assertion `t >= 0 && t < n_classes` failed.\n"
        "THCudaCheck FAIL file=/pytorch/aten/src/THC/THCCachingHostAllocator.cpp line=296 "
        "error=59 : device-side assert triggered\n",
        "device-side assert",
        "cuda",
        id="assert-thc",
    ),
    # HIP spelling of the message; the assertion format is HIP's __assert_fail ("%s:%u: %s:
    # Device-side assertion `%s' failed.") on a hipified Loss.hip.
    pytest.param(
        "torch.AcceleratorError",
        "HIP error: device-side assert triggered" + _HIP_TAIL,
        "/pytorch/aten/src/ATen/native/hip/Loss.hip:247: nll_loss_forward_reduce_cuda_kernel_2d: "
        "Device-side assertion `t >= 0 && t < n_classes' failed.\n",
        "device-side assert",
        "rocm",
        id="assert-hip",
    ),
    # A cuBLAS call is the first to report an earlier embedding assert (user notes, Korean blog).
    pytest.param(
        "RuntimeError",
        "CUDA error: CUBLAS_STATUS_NOT_INITIALIZED when calling `cublasCreate(handle)`",
        "indexSelectLargeIndex: block: [306,0,0], thread: [0,0,0] Assertion "
        "`srcIndex < srcSelectDimSize` failed.\n",
        "device-side assert",
        "cuda",
        id="assert-behind-cublas",
    ),
    # An aborted child: c10 prints the error on stderr and there is no Python message.
    pytest.param(
        "",
        "",
        "terminate called after throwing an instance of 'c10::AcceleratorError'\n"
        "  what():  CUDA error: device-side assert triggered\n",
        "device-side assert",
        "cuda",
        id="assert-abort-stderr-only",
    ),
    # Inductor/Triton kernels (vLLM report); "unknown:0" is the kernel's source location.
    pytest.param(
        "RuntimeError",
        "CUDA error: device-side assert triggered" + _CUDA_TAIL,
        "unknown:0: unknown: block: [0,0,0], thread: [32,0,0] Assertion "
        "`index out of bounds: 0 <= tmp42 < 1024` failed.\n",
        "device-side assert",
        "cuda",
        id="assert-triton",
    ),
    # User reports of illegal access, old and new: FlashMLA issue; THC code 700.
    pytest.param(
        "RuntimeError",
        "CUDA error: an illegal memory access was encountered" + _CUDA_TAIL,
        "",
        "illegal memory access",
        "cuda",
        id="illegal-access-cuda",
    ),
    pytest.param(
        "RuntimeError",
        "cuda runtime error (700) : an illegal memory access was encountered at "
        "/pytorch/aten/src/THC/generic/THCTensorMath.cu:35",
        "",
        "illegal memory access",
        "cuda",
        id="illegal-access-thc",
    ),
    # ComfyUI error report on ROCm (torch.AcceleratorError, hipErrorIllegalAddress).
    pytest.param(
        "torch.AcceleratorError",
        "HIP error: an illegal memory access was encountered\nSearch for "
        "`hipErrorIllegalAddress' in https://rocm.docs.amd.com/projects/HIP/en/latest/index.html "
        "for more information." + _HIP_TAIL,
        "",
        "illegal memory access",
        "rocm",
        id="illegal-access-hip",
    ),
    # The ROCm runtime aborts the process and prints this on stderr (Stable Diffusion report).
    pytest.param(
        "",
        "",
        "Memory access fault by GPU node-1 (Agent handle: 0x55ac14d27600) on address "
        "0x7f9587e00000. Reason: Page not present or supervisor privilege.\n",
        "illegal memory access",
        "rocm",
        id="illegal-access-rocm-fault",
    ),
    # cudaErrorMisalignedAddress gets the asynchronous suffix (CUDAMiscFunctions.cpp).
    pytest.param(
        "torch.AcceleratorError",
        _newest("misaligned address", "cudaErrorMisalignedAddress", asynchronous=True),
        "",
        "illegal memory access",
        "cuda",
        id="misaligned-address",
    ),
    pytest.param(
        "RuntimeError",
        "CUDA error: unspecified launch failure" + _CUDA_TAIL,
        "",
        "launch failure",
        "cuda",
        id="launch-failure",
    ),
    pytest.param(
        "torch.AcceleratorError",
        _newest("an illegal instruction was encountered", "cudaErrorIllegalInstruction", True),
        "",
        "launch failure",
        "cuda",
        id="illegal-instruction",
    ),
    # An evaluation server's FAQ, quoting the 2.x message.
    pytest.param(
        "RuntimeError",
        "CUDA error: uncorrectable ECC error encountered" + _CUDA_TAIL,
        "",
        "uncorrectable ECC error",
        "cuda",
        id="ecc",
    ),
    # torch 2.3+ OutOfMemoryError text (user report, 11.91 GiB card).
    pytest.param(
        "torch.OutOfMemoryError",
        "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 11.91 GiB "
        "of which 406.38 MiB is free. Including non-PyTorch memory, this process has 11.51 GiB "
        "memory in use. Of the allocated memory 11.18 GiB is allocated by PyTorch, and 219.44 "
        "MiB is reserved by PyTorch but unallocated. If reserved but unallocated memory is large "
        "try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  "
        "See documentation for Memory Management  "
        "(https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)",
        "",
        "out of memory",
        "cuda",
        id="oom-cuda-2.3",
    ),
    # torch 1.13-2.0 text (vLLM issue #1201); before 1.13 the same text came as a RuntimeError.
    pytest.param(
        "torch.cuda.OutOfMemoryError",
        "CUDA out of memory. Tried to allocate 1.74 GiB (GPU 0; 47.54 GiB total capacity; "
        "31.64 GiB already allocated; 1.03 GiB free; 31.66 GiB reserved in total by PyTorch) If "
        "reserved memory is >> allocated memory try setting max_split_size_mb to avoid "
        "fragmentation.  See documentation for Memory Management and PYTORCH_CUDA_ALLOC_CONF",
        "",
        "out of memory",
        "cuda",
        id="oom-cuda-1.13",
    ),
    pytest.param(
        "RuntimeError",
        "CUDA out of memory. Tried to allocate 12.00 MiB (GPU 0; 1.95 GiB total capacity; "
        "1023.93 MiB already allocated; 9.94 MiB free; 1.11 GiB reserved in total by PyTorch)",
        "",
        "out of memory",
        "cuda",
        id="oom-cuda-1.x",
    ),
    # torch 1.2-era wording ("cached"), from a transformers user's log.
    pytest.param(
        "RuntimeError",
        "CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; 3.94 GiB total capacity; "
        "1.94 GiB already allocated; 38.06 MiB free; 116.65 MiB cached)",
        "",
        "out of memory",
        "cuda",
        id="oom-cuda-cached",
    ),
    pytest.param(
        "RuntimeError",
        "cuda runtime error (2) : out of memory at /pytorch/aten/src/THC/THCGeneral.cpp:663",
        "",
        "out of memory",
        "cuda",
        id="oom-thc",
    ),
    # cudaMemGetInfo failing on a full device (torch/cuda/memory.py traceback, torch 2.8+).
    pytest.param(
        "torch.AcceleratorError",
        _newest("out of memory", "cudaErrorMemoryAllocation", asynchronous=False),
        "",
        "out of memory",
        "cuda",
        id="oom-cuda-runtime-api",
    ),
    # ROCm wheel OOM, with its own variable and, in torch 2.12, the CUDA spelling of it.
    pytest.param(
        "torch.OutOfMemoryError",
        "HIP out of memory. Tried to allocate 978.00 MiB. GPU 0 has a total capacity of 15.98 "
        "GiB of which 630.00 MiB is free. Of the allocated memory 0 bytes is allocated by "
        "PyTorch, and 0 bytes is reserved by PyTorch but unallocated. If reserved but "
        "unallocated memory is large try setting PYTORCH_HIP_ALLOC_CONF=expandable_segments:True "
        "to avoid fragmentation.  See documentation for Memory Management  "
        "(https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)",
        "",
        "out of memory",
        "rocm",
        id="oom-hip",
    ),
    pytest.param(
        "torch.OutOfMemoryError",
        "HIP out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 15.98 GiB "
        "of which 512.00 MiB is free. If reserved but unallocated memory is large try setting "
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.",
        "",
        "out of memory",
        "rocm",
        id="oom-hip-cuda-spelling",
    ),
    pytest.param(
        "RuntimeError",
        "MPS backend out of memory (MPS allocated: 14.29 GiB, other allocations: 3.65 GiB, max "
        "allowed: 20.13 GiB). Tried to allocate 2.67 GiB on shared pool. Use "
        "PYTORCH_MPS_HIGH_WATERMARK_RATIO=0.0 to disable upper limit for memory allocations "
        "(may cause system failure).",
        "",
        "out of memory",
        None,
        id="oom-mps",
    ),
    # The exception type alone is enough (an allocator that raised with no message).
    pytest.param("torch.OutOfMemoryError", "", "", "out of memory", None, id="oom-type-only"),
    # Host memory: torch 2.13 CPU build, torch.empty(10**15, dtype=torch.uint8).
    pytest.param(
        "RuntimeError",
        "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate "
        "memory: you tried to allocate 1000000000000000 bytes. Error code 12 (Cannot allocate "
        "memory)",
        "",
        "out of memory",
        None,
        id="oom-host",
    ),
    # cuBLAS handle creation without memory (several user reports).
    pytest.param(
        "RuntimeError",
        "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`",
        "",
        "out of memory",
        "cuda",
        id="oom-cublas-alloc",
    ),
    # torch 2.13 CPU build: torch.ones(1, device="cuda").
    pytest.param(
        "AssertionError",
        "Torch not compiled with CUDA enabled",
        "",
        "no usable device",
        "cuda",
        id="not-compiled-with-cuda",
    ),
    pytest.param(
        "RuntimeError",
        "The NVIDIA driver on your system is too old (found version 12090). Please update your "
        "GPU driver by downloading and installing a new version from the URL: "
        "http://www.nvidia.com/Download/index.aspx Alternatively, go to: https://pytorch.org to "
        "install a PyTorch version that has been compiled with your version of the CUDA driver.",
        "",
        "no usable device",
        "cuda",
        id="driver-too-old",
    ),
    # CUDAMiscFunctions.cpp: the one error with its own help line; not asynchronous at main.
    pytest.param(
        "torch.AcceleratorError",
        "CUDA error: invalid device ordinal\nGPU device may be out of range, do you have enough "
        "GPUs?\nFor more detailed error information, run with CUDA_LOG_FILE=stderr\n"
        "Compile with `TORCH_USE_CUDA_DSA` to enable device-side assertions.\n",
        "",
        "invalid device ordinal",
        "cuda",
        id="invalid-ordinal",
    ),
    # Blackwell on a wheel without sm_120 (user reports): the error, and the warning alone.
    pytest.param(
        "RuntimeError",
        "CUDA error: no kernel image is available for execution on the device" + _CUDA_TAIL,
        "",
        "no kernel image",
        "cuda",
        id="no-kernel-image",
    ),
    pytest.param(
        "",
        "",
        "UserWarning: \nNVIDIA GeForce RTX 5090 with CUDA capability sm_120 is not compatible "
        "with the current PyTorch installation.\nThe current PyTorch install supports CUDA "
        "capabilities sm_50 sm_60 sm_61 sm_70 sm_75 sm_80 sm_86 sm_90.\n",
        "no kernel image",
        "cuda",
        id="arch-warning-stderr-only",
    ),
    # ROCm: a gfx target without kernels (several reports), and the runtime's abort line.
    pytest.param(
        "RuntimeError",
        "HIP error: invalid device function" + _HIP_TAIL,
        "",
        "no kernel image",
        "rocm",
        id="hip-invalid-device-function",
    ),
    pytest.param(
        "",
        "",
        '"hipErrorNoBinaryForGpu: Unable to find code object for all current devices!"\n',
        "no kernel image",
        "rocm",
        id="hip-no-binary",
    ),
    # c10/core/op_registration/adaption.cpp, both wordings, and user reports of each.
    pytest.param(
        "RuntimeError",
        "Expected all tensors to be on the same device, but found at least two devices, cuda:0 "
        "and cpu!",
        "",
        "different devices",
        None,
        id="devices-1.x",
    ),
    pytest.param(
        "RuntimeError",
        "Expected all tensors to be on the same device, but found at least two devices, cpu and "
        "cuda:0! (when checking argument for argument mat1 in method wrapper_CUDA_addmm)",
        "",
        "different devices",
        None,
        id="devices-2.0",
    ),
    pytest.param(
        "RuntimeError",
        "Expected all tensors to be on the same device, but got index is on cpu, different from "
        "other tensors on cuda:0 (when checking argument in method wrapper_CUDA__index_select)",
        "",
        "different devices",
        None,
        id="devices-2.5",
    ),
    pytest.param(
        "RuntimeError",
        "Expected object of device type cuda but got device type cpu for argument #1 'self' in "
        "call to _th_addmm",
        "",
        "different devices",
        None,
        id="devices-1.4",
    ),
    pytest.param(
        "RuntimeError",
        "Tensor for argument #2 'mat1' is on CPU, but expected it to be on GPU (while checking "
        "arguments for addmm)",
        "",
        "different devices",
        None,
        id="devices-checked-arg",
    ),
    pytest.param(
        "RuntimeError",
        "indices should be either on cpu or on the same device as the indexed tensor (cpu)",
        "",
        "different devices",
        None,
        id="devices-indices",
    ),
    pytest.param(
        "RuntimeError",
        "Input type (torch.FloatTensor) and weight type (torch.cuda.FloatTensor) should be the "
        "same or input should be a MKLDNN tensor and weight is a dense tensor",
        "",
        "different devices",
        None,
        id="devices-conv-input",
    ),
    # torch 2.13 CPU build: torch.randn(2, 2, device="meta") + torch.randn(2, 2).
    pytest.param(
        "RuntimeError",
        "Tensor on device cpu is not on the expected device meta!",
        "",
        "different devices",
        None,
        id="devices-decomposition",
    ),
    # Apple MPS reports; torch.compile's fake-tensor pass (WhiteFox's recorded results).
    pytest.param(
        "RuntimeError",
        "Placeholder storage has not been allocated on MPS device!",
        "",
        "different devices",
        None,
        id="devices-mps",
    ),
    pytest.param(
        "torch._dynamo.exc.TorchRuntimeError",
        "Failed running call_function <built-in function sub>(*(FakeTensor(..., device='cuda:0', "
        "size=(1, 8, 66, 66)), FakeTensor(..., size=(1,))), **{}):\nUnhandled FakeTensor Device "
        "Propagation for aten.sub.Tensor, found two different devices cuda:0, cpu",
        "",
        "different devices",
        None,
        id="devices-compile",
    ),
    # torch 2.13 CPU build: torch.ones(1, device="mps"); torchvision and xformers reports.
    pytest.param(
        "NotImplementedError",
        "Could not run 'torchvision::nms' with arguments from the 'CUDA' backend. This could be "
        "because the operator doesn't exist for this backend, or was omitted during the "
        "selective/custom build process (if using custom build). If you are a Facebook employee "
        "using PyTorch on mobile, please visit https://fburl.com/ptmfixes for possible "
        "resolutions. 'torchvision::nms' is only available for these backends: [CPU, Meta, "
        "QuantizedCPU, BackendSelect, Python].",
        "",
        "operator not available",
        None,
        id="operator-dispatch",
    ),
    pytest.param(
        "NotImplementedError",
        "The operator 'aten::_linalg_solve_ex.result' is not currently implemented for the MPS "
        "device. If you want this op to be added in priority during the prototype phase of this "
        "feature, please comment on https://github.com/pytorch/pytorch/issues/77764. As a "
        "temporary fix, you can set the environment variable `PYTORCH_ENABLE_MPS_FALLBACK=1` to "
        "use the CPU as a fallback for this op.",
        "",
        "operator not available",
        None,
        id="operator-mps",
    ),
    pytest.param(
        "RuntimeError",
        "operator torchvision::nms does not exist",
        "",
        "operator not available",
        None,
        id="operator-unregistered",
    ),
    # AT_DISPATCH's message: brief's addmm text (CPU Half before 2.1); torch 2.13 CPU build;
    # GradScaler on a T4; int32 targets on CUDA (many reports).
    pytest.param(
        "RuntimeError",
        "\"addmm_impl_cpu_\" not implemented for 'Half'",
        "",
        "dtype not implemented",
        None,
        id="dtype-half",
    ),
    pytest.param(
        "NotImplementedError",
        "\"cholesky_cpu\" not implemented for 'Half'",
        "",
        "dtype not implemented",
        None,
        id="dtype-half-2.13",
    ),
    pytest.param(
        "NotImplementedError",
        "\"_amp_foreach_non_finite_check_and_unscale_cuda\" not implemented for 'BFloat16'",
        "",
        "dtype not implemented",
        None,
        id="dtype-bfloat16",
    ),
    pytest.param(
        "RuntimeError",
        "linalg.inv: Low precision dtypes not supported. Got BFloat16",
        "",
        "dtype not implemented",
        None,
        id="dtype-low-precision",
    ),
    # torch 2.13 CPU build (the first three); torchbench's skip list; user reports.
    pytest.param(
        "RuntimeError",
        "expected m1 and m2 to have the same dtype, but got: float != double",
        "",
        "dtype mismatch",
        None,
        id="mismatch-mm",
    ),
    pytest.param(
        "RuntimeError",
        "Input type (double) and bias type (float) should be the same",
        "",
        "dtype mismatch",
        None,
        id="mismatch-conv-bias",
    ),
    pytest.param(
        "RuntimeError",
        "expected target dtype to be Long or Byte, but got Int",
        "",
        "dtype mismatch",
        None,
        id="mismatch-target",
    ),
    pytest.param(
        "RuntimeError",
        "mat1 and mat2 must have the same dtype, but got Float and BFloat16",
        "",
        "dtype mismatch",
        None,
        id="mismatch-mat",
    ),
    pytest.param(
        "RuntimeError",
        "expected scalar type Float but found Half",
        "",
        "dtype mismatch",
        None,
        id="mismatch-scalar-type",
    ),
    # Both on the GPU: a dtype mismatch, not a device one.
    pytest.param(
        "RuntimeError",
        "Input type (torch.cuda.HalfTensor) and weight type (torch.cuda.FloatTensor) should be "
        "the same",
        "",
        "dtype mismatch",
        None,
        id="mismatch-conv-cuda",
    ),
    # User reports.
    pytest.param(
        "RuntimeError",
        "CUDA error: CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasSgemm( handle, opa, opb, "
        "m, n, k, &alpha, a, lda, b, ldb, &beta, c, ldc)`",
        "",
        "cuDNN/cuBLAS error",
        "cuda",
        id="cublas",
    ),
    pytest.param(
        "RuntimeError",
        "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED. This error may appear if you passed in a "
        "non-contiguous input.",
        "",
        "cuDNN/cuBLAS error",
        "cuda",
        id="cudnn",
    ),
    # torch 2.13 CPU build: cross_entropy, embedding, indexing, gather, one_hot.
    pytest.param(
        "IndexError",
        "Target 4 is out of bounds.",
        "",
        "index out of range (CPU)",
        None,
        id="cpu-target",
    ),
    pytest.param(
        "IndexError",
        "index out of range in self",
        "",
        "index out of range (CPU)",
        None,
        id="cpu-embedding",
    ),
    pytest.param(
        "IndexError",
        "index 5 is out of bounds for dimension 0 with size 3",
        "",
        "index out of range (CPU)",
        None,
        id="cpu-indexing",
    ),
    pytest.param(
        "RuntimeError",
        "index 5 is out of bounds for dimension 1 with size 3",
        "",
        "index out of range (CPU)",
        None,
        id="cpu-gather",
    ),
    pytest.param(
        "RuntimeError",
        "Class values must be smaller than num_classes.",
        "",
        "index out of range (CPU)",
        None,
        id="cpu-one-hot",
    ),
    pytest.param(
        "RuntimeError",
        "all elements of input should be between 0 and 1",
        "",
        "value out of range (CPU)",
        None,
        id="cpu-bce",
    ),
    # torch 2.13 CPU build: anomaly mode, clip_grad_norm_, multinomial, distributions.
    pytest.param(
        "RuntimeError",
        "Function 'SqrtBackward0' returned nan values in its 0th output.",
        "",
        "NaN/inf",
        None,
        id="nan-anomaly",
    ),
    pytest.param(
        "RuntimeError",
        "The total norm of order 2.0 for gradients from `parameters` is non-finite, so it cannot "
        "be clipped. To disable this error and scale the gradients by the non-finite norm "
        "anyway, set `error_if_nonfinite=False`",
        "",
        "NaN/inf",
        None,
        id="nan-clip",
    ),
    pytest.param(
        "RuntimeError",
        "probability tensor contains either `inf`, `nan` or element < 0",
        "",
        "NaN/inf",
        None,
        id="nan-multinomial",
    ),
    pytest.param(
        "ValueError",
        "Expected parameter loc (Tensor of shape (1,)) of distribution Normal(loc: "
        "tensor([nan]), scale: tensor([1.])) to satisfy the constraint Real(), but found invalid "
        "values:\ntensor([nan])",
        "",
        "NaN/inf",
        None,
        id="nan-distribution",
    ),
]


def _triage_of(case: Any) -> Triage | None:
    """Triage one of CASES (a pytest.param) from its error type, message and stderr."""
    error_type, message, stderr = case.values[:3]
    return triage(error_type, message, stderr)


@pytest.mark.parametrize(("error_type", "message", "stderr", "clue", "backend"), CASES)
def test_real_message_gives_its_clue_and_backend(
    error_type: str, message: str, stderr: str, clue: str, backend: str | None
) -> None:
    found = triage(error_type, message, stderr)
    assert found is not None
    assert (found.clue, found.backend) == (clue, backend)


@pytest.mark.parametrize(
    ("clue", "asynchronous", "sticky"),
    [
        ("device-side assert", True, True),
        ("illegal memory access", True, True),
        ("launch failure", True, True),
        ("uncorrectable ECC error", False, True),
        ("out of memory", False, False),
        ("different devices", False, False),
        ("operator not available", False, False),
        ("index out of range (CPU)", False, False),
    ],
)
def test_only_kernel_faults_are_asynchronous_and_sticky(
    clue: str, asynchronous: bool, sticky: bool
) -> None:
    found = [t for case in CASES if (t := _triage_of(case)) is not None and t.clue == clue]
    assert found
    assert {(t.asynchronous, t.sticky) for t in found} == {(asynchronous, sticky)}


@pytest.mark.parametrize(
    ("error_type", "message"),
    [
        ("RuntimeError", "mat1 and mat2 shapes cannot be multiplied (2x3 and 4x5)"),
        # HAMi's vGPU limit surfaces as an unknown code: no clue rather than a wrong one.
        ("RuntimeError", "CUDA error: unrecognized error code" + _CUDA_TAIL),
        ("KeyError", "'image'"),
        ("", ""),
    ],
)
def test_no_clue_gives_none(error_type: str, message: str) -> None:
    assert triage(error_type, message) is None


def test_render_of_a_cuda_device_side_assert() -> None:
    found = triage(
        "RuntimeError", "CUDA error: device-side assert triggered" + _CUDA_TAIL, _LOSS_STDERR
    )
    assert found is not None
    assert found.render().splitlines() == [
        "clue: device-side assert (CUDA)",
        (
            "first check: Check the indices, targets and operator conditions that reached the "
            "kernel: class targets in [0, num_classes) or ignore_index, embedding/gather/index_select "
            "indices below the size of the indexed dimension, probabilities in [0, 1]."
        ),
        (
            "avoid: Do not conclude the GPU is broken: a device-side assert is an input check that "
            "failed inside a kernel."
        ),
        (
            "asynchronous: reported at a later call, so the traceback may point past the cause; "
            "rerun with CUDA_LAUNCH_BLOCKING=1 to stop at the failing kernel"
        ),
        (
            "restart: the process must be restarted before any reproduction: the device context is "
            "unusable after this error"
        ),
        "note: kernel assertion: " + _LOSS_CU.format(t=0).strip(),
        (
            "note: meaning: a class target is outside [0, num_classes) and not ignore_index "
            "(nll_loss, cross_entropy)"
        ),
        (
            "note: Replaying the same inputs on CPU usually turns this into a readable error (e.g. "
            "'Target 4 is out of bounds.'); a CPU pass is a hint, not CUDA validation."
        ),
    ]


def test_rocm_assert_says_asserts_are_off_in_release_wheels_and_how_to_serialize() -> None:
    found = triage("torch.AcceleratorError", "HIP error: device-side assert triggered" + _HIP_TAIL)
    assert found is not None
    text = found.render()
    assert "clue: device-side assert (ROCm)" in text
    assert "rerun with AMD_SERIALIZE_KERNEL=3" in text
    assert "note: ROCm release wheels are built with kernel asserts off" in text


def test_every_sticky_clue_says_restart_and_others_do_not() -> None:
    for case in CASES:
        found = _triage_of(case)
        assert found is not None
        restarts = "must be restarted before any reproduction" in found.render()
        assert restarts == found.sticky, case.id


def test_out_of_memory_first_check_and_conclusion_to_avoid() -> None:
    found = triage("torch.OutOfMemoryError", "CUDA out of memory. Tried to allocate 2.00 GiB")
    assert found is not None
    assert "shapes" in found.first_check
    assert "tensors kept alive" in found.first_check
    assert "other processes" in found.first_check
    assert "every CUDA error as low VRAM" in found.avoid
    assert found.notes == ()


@pytest.mark.parametrize(
    ("message", "note"),
    [
        (
            (
                "Expected all tensors to be on the same device, but found at least two devices, "
                "cuda:0 and cpu!"
            ),
            "devices involved: cuda:0 and cpu",
        ),
        (
            (
                "Expected all tensors to be on the same device, but got index is on cpu, different "
                "from other tensors on cuda:0 (when checking argument in method "
                "wrapper_CUDA__index_select)"
            ),
            "argument index is on cpu; the other tensors are on cuda:0",
        ),
        (
            "\"nll_loss_forward_reduce_cuda_kernel_2d_index\" not implemented for 'Int'",
            "the class targets are Int: cross_entropy and nll_loss take int64 (long) class indices",
        ),
        (
            "Could not run 'torchvision::nms' with arguments from the 'CUDA' backend.",
            "torchvision::nms has no kernel for the CUDA dispatch key in this build",
        ),
        (
            "Target 4 is out of bounds.",
            "a class target is 4: targets must lie in [0, num_classes) or equal ignore_index",
        ),
        (
            "Function 'LogSoftmaxBackward0' returned nan values in its 0th output.",
            "anomaly mode names LogSoftmaxBackward0 as the first backward function to return NaN",
        ),
    ],
)
def test_details_read_from_the_message_become_notes(message: str, note: str) -> None:
    found = triage("RuntimeError", message)
    assert found is not None
    assert note in found.notes


@pytest.mark.parametrize(
    ("line", "meaning"),
    [
        (
            (
                "../aten/src/ATen/native/cuda/Indexing.cu:1292: indexSelectLargeIndex: block: "
                "[222,0,0], thread: [96,0,0] Assertion `srcIndex < srcSelectDimSize` failed."
            ),
            "nn.Embedding: a token id >= num_embeddings",
        ),
        (
            (
                "../aten/src/ATen/native/cuda/IndexKernel.cu:92: operator(): block: [16,0,0], thread: "
                '[0,0,0] Assertion `-sizes[i] <= index && index < sizes[i] && "index out of bounds"` '
                "failed."
            ),
            "an index is outside the dimension it indexes",
        ),
        (
            (
                "../aten/src/ATen/native/cuda/ScatterGatherKernel.cu:144: operator(): block: [2,0,0], "
                "thread: [14,0,0] Assertion `idx_dim >= 0 && idx_dim < index_size && "
                '"index out of bounds"` failed.'
            ),
            "an index is outside the dimension it indexes",
        ),
        (
            (
                "../aten/src/ATen/native/cuda/Loss.cu:92: operator(): block: [79,0,0], thread: "
                "[118,0,0] Assertion `input_val >= zero && input_val <= one` failed."
            ),
            "binary_cross_entropy got an input outside [0, 1]",
        ),
    ],
)
def test_kernel_assertion_is_quoted_and_explained(line: str, meaning: str) -> None:
    found = triage("RuntimeError", "CUDA error: device-side assert triggered", line + "\n")
    assert found is not None
    assert found.notes[0] == f"kernel assertion: {line}"
    assert found.notes[1].startswith("meaning: ")
    assert meaning in found.notes[1]


def test_a_message_clue_wins_over_an_unrelated_warning_on_stderr() -> None:
    warning = (
        "NVIDIA GeForce RTX 5090 with CUDA capability sm_120 is not compatible with the current "
        "PyTorch installation.\n"
    )
    message = "Expected all tensors to be on the same device, but found at least two devices"
    found = triage("RuntimeError", message, warning)
    assert found is not None
    assert found.clue == "different devices"


def test_to_dict_is_plain_data() -> None:
    found = triage("torch.OutOfMemoryError", "HIP out of memory. Tried to allocate 2.00 GiB")
    assert found is not None
    assert found.to_dict() == {
        "clue": "out of memory",
        "first_check": found.first_check,
        "avoid": found.avoid,
        "asynchronous": False,
        "sticky": False,
        "backend": "rocm",
        "notes": [],
    }


def test_triage_is_a_frozen_value() -> None:
    found = Triage("c", "f", "a", asynchronous=False, sticky=False, backend=None)
    with pytest.raises(AttributeError):
        found.clue = "other"  # type: ignore[misc]


def test_assertion_line_is_the_first_one() -> None:
    stderr = "some warning\n" + _LOSS_STDERR
    assert assertion_line(stderr) == _LOSS_CU.format(t=0).strip()


def test_assertion_line_reads_the_hip_format() -> None:
    line = (
        "/pytorch/aten/src/ATen/native/hip/Loss.hip:247: nll_loss_forward_reduce_cuda_kernel_2d: "
        "Device-side assertion `t >= 0 && t < n_classes' failed."
    )
    assert assertion_line(f"  {line}\n") == line


@pytest.mark.parametrize(
    "stderr",
    ["", "Traceback (most recent call last):\nAssertionError: shapes differ\n"],
)
def test_assertion_line_is_none_without_a_kernel_assertion(stderr: str) -> None:
    assert assertion_line(stderr) is None


@pytest.mark.slow
@pytest.mark.parametrize(
    "text",
    [
        "Assertion `" * 200_000,
        "Device-side assertion `" * 100_000,
        "to satisfy the constraint " * 80_000,
        "Could not run '" * 150_000,
        "Input type (" * 150_000,
        "Tensor on device " + "x" * 2_000_000,
        "operator " * 200_000,
        "a" * 2_000_000,
    ],
    ids=["assert", "hip-assert", "constraint", "could-not-run", "input-type", "long-token",
         "operator", "one-word"],
)
def test_triage_of_a_pathological_text_is_linear(text: str) -> None:
    import time

    start = time.process_time()
    triage("RuntimeError", text, text)
    assertion_line(text)
    # A hang guard on a loaded machine, not a benchmark: quadratic patterns take minutes here.
    assert time.process_time() - start < 5


def test_only_the_start_and_end_of_a_long_text_are_read() -> None:
    from pytest_gpucase.verdict.triage import SCANNED, bounded

    noise = "x" * (10 * SCANNED)
    assert bounded("short") == "short"
    text = bounded("HEAD " + noise + " TAIL")
    assert text.startswith("HEAD ") and text.endswith(" TAIL")
    assert len(text) < 2 * SCANNED + 100
    found = triage("RuntimeError", "", noise + "\nRuntimeError: CUDA error: device-side assert triggered\n")
    assert found is not None and found.clue == "device-side assert"


# --- The loader's refusals: an extension built for another torch, CUDA or C++ runtime -----

from pathlib import Path  # noqa: E402

from pytest_gpucase.verdict.triage import failure_class, loader_words  # noqa: E402
from tests.extension_builds import compile_extension  # noqa: E402

# Real texts, verbatim from user reports (the first two from the PyTorch and flash-attn
# trackers), for loaders this machine cannot produce.
LOADER_TEXTS = {
    "abi-mismatch": [
        "/usr/local/lib/python3.10/dist-packages/flash_attn_2_cuda.cpython-310-x86_64-linux-gnu.so: undefined symbol: _ZN3c104cuda9SetDeviceEi",
        "/opt/conda/lib/python3.11/site-packages/torch_scatter/_scatter_cuda.so: undefined symbol: _ZNK3c1010TensorImpl36is_contiguous_nondefault_policy_implENS_12MemoryFormatE",
        "dlopen(/Users/me/venv/lib/python3.11/site-packages/rowext/_C.cpython-311-darwin.so, 0x0002): symbol not found in flat namespace '__ZN3c1017RegisterOperatorsD1Ev'",
        "DLL load failed while importing _C: The specified procedure could not be found.",
    ],
    "library-missing": [
        "libcudart.so.11.0: cannot open shared object file: No such file or directory",
        "libc10.so: cannot open shared object file: No such file or directory",
        "DLL load failed while importing _C: The specified module could not be found.",
    ],
    "runtime-too-old": [
        "/opt/conda/lib/libstdc++.so.6: version `GLIBCXX_3.4.30' not found (required by /usr/lib/python3/dist-packages/rowext/_C.cpython-311-x86_64-linux-gnu.so)",
        "/lib/x86_64-linux-gnu/libc.so.6: version `GLIBC_2.32' not found (required by /home/u/.local/lib/python3.10/site-packages/xformers/_C.so)",
    ],
}


@pytest.mark.parametrize(("kind", "text"), [(kind, text) for kind, texts in LOADER_TEXTS.items()
                                           for text in texts])
def test_loader_refusals_are_classed_and_quoted(kind: str, text: str) -> None:
    assert failure_class("ImportError", text) == kind
    found = triage("ImportError", text)
    assert found is not None and "reinstall everything" not in found.first_check
    assert loader_words(f"Traceback ...\nImportError: {text}\n") == f"ImportError: {text}"


def _import_error(folder: Path, defines: tuple[str, ...]) -> str:
    """The text of the ImportError the real loader raises for a real extension module."""
    import importlib.util

    compiled = compile_extension(folder, defines=defines)
    spec = importlib.util.spec_from_file_location("_C", compiled)
    assert spec is not None and spec.loader is not None
    with pytest.raises(ImportError) as raised:
        spec.loader.exec_module(importlib.util.module_from_spec(spec))
    return str(raised.value)


@pytest.mark.slow   # compiles a real extension module
def test_a_real_undefined_torch_symbol(tmp_path: Path) -> None:
    text = _import_error(tmp_path, ("NEEDS_TORCH_SYMBOL",))
    assert "undefined symbol: _ZN5torch7Library4_defEPKc" in text   # glibc's own words
    message = f"{text} (torch 2.13.0 here, rowext 2.0 built for torch 2.9.1)"
    found = triage("ImportError", message)
    assert found is not None
    assert found.clue == "extension built for another torch or CUDA"
    assert found.notes[0] == ("rebuild rowext 2.0 against torch 2.13.0, the torch it runs "
                              "with here (it was built for torch 2.9.1)")
    assert "_ZN5torch7Library4_defEPKc is torch's own C++ API" in found.render()
    assert loader_words(message) == message


@pytest.mark.slow   # compiles a real extension module
def test_a_real_missing_library(tmp_path: Path) -> None:
    text = _import_error(tmp_path, ("NEEDS_LIBRARY",))
    assert text == "libgpucase_missing.so: cannot open shared object file: No such file or directory"
    found = triage("ImportError", text)
    assert found is not None and found.clue == "shared library not found"
    assert "the loader could not find libgpucase_missing.so" in found.notes


def test_a_cuda_library_names_the_cuda_the_build_wanted() -> None:
    found = triage("OSError", "libcudart.so.12: cannot open shared object file: No such file")
    assert found is not None and "libcudart.so.12: the extension was built for CUDA 12" in found.notes


@pytest.mark.parametrize("text", [
    "'_OpNamespace' 'rowext' object has no attribute 'logsumexp'",
    "No such operator rowext::logsumexp",
    "Could not run 'rowext::logsumexp' with arguments from the 'CUDA' backend. This could be because the operator doesn't exist for this backend, or was omitted during the selective/custom build process (if using custom build).",
])
def test_an_operator_the_extension_does_not_provide(text: str) -> None:
    found = triage("RuntimeError", text)
    assert found is not None and found.clue == "operator not available"
    assert loader_words(text) is None   # the import worked: no loader refusal


def test_other_import_failures_are_not_the_loaders() -> None:
    assert loader_words("No module named 'rowext'") is None
    assert loader_words("cannot import name 'pool' from 'rowext'") is None
