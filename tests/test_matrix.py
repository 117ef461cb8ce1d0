"""Requirements against an environment, and the expansion of a case into runs."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from pytest_gpucase.case.model import (
    AxisSizes,
    Boundaries,
    Case,
    Expectation,
    Requirements,
    VariantTables,
)
from pytest_gpucase.plan.environment import Device, Environment
from pytest_gpucase.plan.runs import (
    DEFAULT_DEVICES,
    RunSpec,
    device_skip,
    evaluate,
    expand,
    saved_float_dtype,
)
from pytest_gpucase.plan.runs import NotRunnable
from pytest_gpucase.case.payload import TensorInfo
from pytest_gpucase.plan.runs import choose_device
from pytest_gpucase.case.variants import Variant

H100 = Device(0, "NVIDIA H100 80GB HBM3", "9.0", 79.1)
CPU = Environment(backend="cpu", device_types=("cpu",), torch="2.4.0", python="3.11.7")
CUDA = Environment(backend="cuda", device_types=("cuda", "cpu"), devices=(H100,),
                   torch="2.4.0+cu124", cuda="12.4", cudnn="90100", python="3.11.7")
T4 = replace(CUDA, devices=(Device(0, "Tesla T4", "7.5"),))
ROCM = Environment(backend="rocm", device_types=("cuda", "cpu"),
                   devices=(Device(0, "AMD Instinct MI250X", "gfx90a:sramecc+:xnack-"),),
                   torch="2.3.0+rocm6.0", hip="6.0.32830-d62f6a171", cudnn="3001000",
                   python="3.11.7")
MPS = Environment(backend="mps", device_types=("mps", "cpu"), devices=(Device(0, "Apple MPS"),),
                  torch="2.4.0", python="3.11.7")
NO_CUDA_HINT = ("no CUDA device here (cpu backend): a CPU pass is a hint, not CUDA "
                "validation; run it on a GPU runner")
REJECT = Expectation(outcome="raises", exception="ValueError", match="out of range")


def make_case(matrix: Requirements | None = None, variants: VariantTables | None = None,
              launch_blocking: bool = False) -> Case:
    return Case(
        name="ce_class4", path=Path("cases/ce_class4"), summary="", call="case.py:run",
        reference=None, timeout=120.0, launch_blocking=launch_blocking, xfail=None,
        literals={}, expect=Expectation(), matrix=matrix or Requirements(),
        variants=variants or VariantTables(), ablate_env={}, origin={},
    )


def ids(specs: list[RunSpec]) -> list[str]:
    return [spec.id for spec in specs]


# ----------------------------------------------------------------------------- evaluate


@pytest.mark.parametrize(("req", "env", "reason"), [
    pytest.param(Requirements(), CPU, None, id="nothing-required"),
    pytest.param(Requirements(backends=("cuda", "rocm")), CUDA, None, id="backend-met"),
    pytest.param(Requirements(backends=("rocm",)), CUDA,
                 "requires backend rocm; this is a CUDA build", id="backend-rocm-on-cuda"),
    pytest.param(Requirements(backends=("cuda", "rocm")), CPU,
                 "requires backend cuda or rocm; this is a CPU-only build", id="backend-on-cpu"),
    pytest.param(Requirements(backends=("cuda",)), ROCM,
                 "requires backend cuda; this is a ROCm build", id="backend-cuda-on-rocm"),
    pytest.param(Requirements(backends=("cpu",)), MPS,
                 "requires backend cpu; this is an MPS (Apple) build", id="backend-on-mps"),
    pytest.param(Requirements(versions={"torch": ">=2.3"}), replace(CPU, torch="2.2.0"),
                 "requires torch>=2.3; found 2.2.0", id="torch-too-old"),
    pytest.param(Requirements(versions={"torch": ">=2.3"}), CPU, None, id="torch-met"),
    pytest.param(Requirements(versions={"torch": ">=2.3"}), replace(CPU, torch=None),
                 "requires torch>=2.3; torch is not installed", id="torch-missing"),
    pytest.param(Requirements(versions={"python": ">=3.10"}), CPU, None, id="python-met"),
    pytest.param(Requirements(versions={"python": ">=3.12"}), CPU,
                 "requires python>=3.12; found 3.11.7", id="python-too-old"),
    pytest.param(Requirements(versions={"cuda": ">=12.1"}), CUDA, None, id="cuda-met"),
    pytest.param(Requirements(versions={"cuda": ">=12.1"}), replace(CUDA, cuda="11.8"),
                 "requires cuda>=12.1; found 11.8", id="cuda-too-old"),
    pytest.param(Requirements(versions={"cuda": ">=12.1"}), CPU,
                 "requires cuda>=12.1; this is a CPU-only build (torch.version.cuda is None)",
                 id="cuda-on-cpu-build"),
    pytest.param(Requirements(versions={"cuda": ">=12.1"}), ROCM,
                 "requires cuda>=12.1; this is a ROCm build (torch.version.cuda is None)",
                 id="cuda-on-rocm-build"),
    pytest.param(Requirements(versions={"hip": ">=6.0"}), ROCM, None, id="hip-met"),
    pytest.param(Requirements(versions={"hip": "<6.0"}), ROCM,
                 "requires hip<6.0; found 6.0.32830-d62f6a171", id="hip-too-new"),
    pytest.param(Requirements(versions={"hip": ">=6.0"}), CUDA,
                 "requires hip>=6.0; this is a CUDA build (torch.version.hip is None)",
                 id="hip-on-cuda-build"),
    pytest.param(Requirements(versions={"capability": ">=8.0"}), CUDA, None,
                 id="capability-met"),
    pytest.param(Requirements(versions={"capability": ">=8.0"}), T4,
                 "requires capability>=8.0; found 7.5 (Tesla T4)", id="capability-too-low"),
    pytest.param(Requirements(versions={"capability": ">=8.0"}),
                 replace(CUDA, devices=(Device(0, "NVIDIA B200", "10.0"),)), None,
                 id="capability-10.0-is-above-8.0"),
    pytest.param(Requirements(versions={"capability": ">=8.0"}),
                 replace(CUDA, devices=(H100, Device(1, "Tesla T4", "7.5"))),
                 "requires capability>=8.0; found 7.5 (Tesla T4)", id="capability-every-device"),
    pytest.param(Requirements(versions={"capability": ">=8.0"}), CPU,
                 "requires capability>=8.0; no accelerator here", id="capability-on-cpu"),
    pytest.param(Requirements(versions={"capability": ">=8.0"}), ROCM,
                 "requires capability>=8.0; AMD Instinct MI250X reports gfx90a:sramecc+:xnack-, "
                 "a ROCm architecture name, not a CUDA compute capability",
                 id="capability-on-rocm"),
    pytest.param(Requirements(versions={"capability": ">=8.0"}), MPS,
                 "requires capability>=8.0; Apple MPS reports no compute capability",
                 id="capability-on-mps"),
    pytest.param(Requirements(packages={"flash-attn": ">=2.5"}), CUDA,
                 "requires flash-attn>=2.5; not installed", id="package-not-probed"),
    pytest.param(Requirements(packages={"flash-attn": ">=2.5"}),
                 replace(CUDA, packages={"flash-attn": None}),
                 "requires flash-attn>=2.5; not installed", id="package-not-installed"),
    pytest.param(Requirements(packages={"flash-attn": ">=2.5"}),
                 replace(CUDA, packages={"flash-attn": "2.4.0"}),
                 "requires flash-attn>=2.5; found 2.4.0", id="package-too-old"),
    pytest.param(Requirements(packages={"flash-attn": ">=2.5"}),
                 replace(CUDA, packages={"flash-attn": "2.5.8"}), None, id="package-met"),
    pytest.param(Requirements(packages={"flash-attn": ""}),
                 replace(CUDA, packages={"flash-attn": "0.1"}), None, id="package-any-version"),
    pytest.param(Requirements(packages={"flash-attn": ""}),
                 replace(CUDA, packages={"flash-attn": None}),
                 "requires flash-attn; not installed", id="package-must-be-installed"),
    pytest.param(Requirements(packages={"apex": ">=0.1"}), replace(CUDA, packages={"apex": "?"}),
                 "requires apex>=0.1; found ?, which is not a PEP 440 version",
                 id="package-unreadable-version"),
])
def test_evaluate(req: Requirements, env: Environment, reason: str | None) -> None:
    assert evaluate(req, env) == reason


@pytest.mark.parametrize(("found", "specifier"), [
    ("2.3.1+cu121", ">=2.3"),            # local version of a CUDA wheel
    ("2.3.1+cu121", "==2.3.1"),          # == ignores the local part
    ("2.3.1+cu121", "~=2.3"),
    ("2.4.0a0+git3f2c1ab", ">=2.3"),     # a source build: pre-release of the next version
    ("2.4.0.dev20240401+cu121", ">=2.3"),  # a nightly
    ("2.4.0.dev20240401+cu121", ">=2.3,<2.5"),
])
def test_torch_builds_that_meet_a_requirement(found: str, specifier: str) -> None:
    assert evaluate(Requirements(versions={"torch": specifier}), replace(CUDA, torch=found)) is None


@pytest.mark.parametrize(("found", "specifier"), [
    ("2.3.1+cu121", "==2.3.0"),
    ("2.3.0a0+git3f2c1ab", ">=2.3"),     # before 2.3 was released: may lack what 2.3 has
    ("2.4.0.dev20240401+cu121", "<2.4"),  # PEP 440: "<2.4" excludes 2.4's pre-releases
])
def test_torch_builds_that_miss_a_requirement(found: str, specifier: str) -> None:
    req = Requirements(versions={"torch": specifier})
    assert evaluate(req, replace(CUDA, torch=found)) == f"requires torch{specifier}; found {found}"


def test_the_backend_is_checked_before_versions_and_versions_before_packages() -> None:
    env = replace(T4, packages={"flash-attn": None})
    everything = Requirements(backends=("rocm",), versions={"capability": ">=8.0"},
                              packages={"flash-attn": ">=2.5"})
    assert evaluate(everything, env) == "requires backend rocm; this is a CUDA build"
    assert evaluate(replace(everything, backends=None), env) == (
        "requires capability>=8.0; found 7.5 (Tesla T4)")
    assert evaluate(replace(everything, backends=None, versions={}), env) == (
        "requires flash-attn>=2.5; not installed")


# ----------------------------------------------------------------------------- saved dtype


def info(dtype: str, *shape: int) -> TensorInfo:
    stride = tuple(1 for _ in shape)
    return TensorInfo(name=f"t{dtype}{shape}", dtype=dtype, shape=shape, stride=stride,
                      storage_offset=0)


@pytest.mark.parametrize(("inputs", "expected"), [
    ([info("F32", 4, 3), info("I64", 4)], "float32"),
    ([info("F32", 3), info("BF16", 8, 8), info("I64", 100)], "bfloat16"),
    ([info("F16", 2, 2), info("F64", 3)], "float16"),
    ([info("F64", 16), info("F32", 4)], "float64"),
    ([info("F8_E4M3", 1000), info("C64", 1000), info("F32", 2)], "float32"),
    ([info("I64", 4), info("BOOL", 4)], None),
    ([], None),
])
def test_saved_float_dtype_is_that_of_the_largest_floating_input(
        inputs: list[TensorInfo], expected: str | None) -> None:
    assert saved_float_dtype(inputs) == expected


# ----------------------------------------------------------------------------- devices


def test_device_skip() -> None:
    assert device_skip("cpu", CPU) is None
    assert device_skip("cuda", CUDA) is None
    assert device_skip("cuda", ROCM) is None          # ROCm is torch.cuda on a HIP build
    assert device_skip("cuda", CPU) == NO_CUDA_HINT
    assert device_skip("mps", CUDA) == "no mps device here (cuda backend)"


def test_default_devices_are_cpu_and_cuda() -> None:
    assert DEFAULT_DEVICES == ("cpu", "cuda")
    specs = expand(make_case(), CPU, saved_dtype="float32")
    assert ids(specs) == ["cpu-float32", "cuda-float32"]
    assert [spec.skip for spec in specs] == [None, NO_CUDA_HINT]
    assert [spec.cast for spec in specs] == [False, False]


def test_default_devices_add_any_other_available_type() -> None:
    specs = expand(make_case(), MPS, saved_dtype="float32")
    assert ids(specs) == ["cpu-float32", "cuda-float32", "mps-float32"]
    assert [spec.skip for spec in specs] == [
        None, NO_CUDA_HINT.replace("cpu backend", "mps backend"), None]


def test_the_case_lists_its_devices_in_its_order() -> None:
    specs = expand(make_case(Requirements(devices=("cuda", "cpu"))), CUDA, saved_dtype=None)
    assert ids(specs) == ["cuda-float32", "cpu-float32"]
    assert [spec.skip for spec in specs] == [None, None]


@pytest.mark.parametrize(("case_devices", "option", "expected"), [
    (None, ["cuda"], ["cuda-float32"]),
    (None, ["cpu", "cuda"], ["cpu-float32", "cuda-float32"]),
    (("cpu",), ["cuda"], []),                      # an option never adds a device
    (None, ["xpu"], ["xpu-float32"]),  # asked for by name: an item, skipped with the reason
    (("cuda", "cpu"), ["cpu", "xpu"], ["cpu-float32"]),
])
def test_gpu_devices_narrows(case_devices: tuple[str, ...] | None, option: list[str],
                             expected: list[str]) -> None:
    case = make_case(Requirements(devices=case_devices))
    assert ids(expand(case, CUDA, saved_dtype="float32", devices=option)) == expected


# ----------------------------------------------------------------------------- dtypes


def test_dtypes_default_to_the_saved_one_without_a_cast() -> None:
    specs = expand(make_case(), CPU, saved_dtype="bfloat16")
    assert [(spec.dtype, spec.cast) for spec in specs] == [("bfloat16", False)] * 2
    assert [spec.dtype for spec in expand(make_case(), CPU, saved_dtype=None)] == ["float32"] * 2


def test_listed_dtypes_cast_the_floating_inputs() -> None:
    case = make_case(Requirements(devices=("cuda",), dtypes=("float32", "bfloat16")))
    specs = expand(case, CUDA, saved_dtype="float32")
    assert ids(specs) == ["cuda-float32", "cuda-bfloat16"]
    assert [spec.cast for spec in specs] == [True, True]


@pytest.mark.parametrize(("case_dtypes", "option", "expected"), [
    (("float32", "bfloat16"), ["bfloat16"], ["cuda-bfloat16"]),
    (("float32", "bfloat16"), ["float16", "bfloat16", "float32"],
     ["cuda-float32", "cuda-bfloat16"]),
    (("float32",), ["bfloat16"], []),              # an option never adds a dtype
    (None, ["float32"], ["cuda-float32"]),
    (None, ["bfloat16"], []),                      # saved float32: no bfloat16 run to keep
])
def test_gpu_dtypes_narrows(case_dtypes: tuple[str, ...] | None, option: list[str],
                            expected: list[str]) -> None:
    case = make_case(Requirements(devices=("cuda",), dtypes=case_dtypes))
    assert ids(expand(case, CUDA, saved_dtype="float32", dtypes=option)) == expected


# ----------------------------------------------------------------------------- variants


def test_ids_read_like_pytorch_device_type_tests() -> None:
    variants = VariantTables(batch=AxisSizes(0, (1,)), boundaries=Boundaries("target", 4, -100),
                             reject=REJECT)
    case = make_case(Requirements(dtypes=("float32", "bfloat16")), variants)
    found = ids(expand(case, CUDA, saved_dtype="float32"))
    per_dtype = ["", "-batch[1]", "-boundary[0]", "-boundary[3]", "-boundary[-100]",
                 "-boundary[-1]", "-boundary[4]"]
    assert found == [f"{device}-{dtype}{suffix}" for device in ("cpu", "cuda")
                     for dtype in ("float32", "bfloat16") for suffix in per_dtype]
    assert "cuda-bfloat16-batch[1]" in found
    assert "cpu-float32-boundary[-100]" in found


def test_every_run_carries_its_variant() -> None:
    variants = VariantTables(length=AxisSizes(1, (4096,)))
    specs = expand(make_case(Requirements(devices=("cpu",)), variants), CPU, saved_dtype=None)
    assert [spec.variant for spec in specs] == [None, Variant("length", 4096, axis=1)]
    assert RunSpec(specs[0].case, "cpu", "float32", False).id == "cpu-float32"


def test_an_unmet_requirement_skips_every_run_with_its_reason() -> None:
    case = make_case(Requirements(versions={"torch": ">=2.5"}),
                     VariantTables(batch=AxisSizes(0, (1,))))
    specs = expand(case, CPU, saved_dtype="float32")
    assert ids(specs) == ["cpu-float32", "cpu-float32-batch[1]", "cuda-float32",
                          "cuda-float32-batch[1]"]
    # The requirement is named before the missing device: it holds on every runner.
    assert {spec.skip for spec in specs} == {"requires torch>=2.5; found 2.4.0"}



def test_a_capability_holds_back_the_accelerator_runs_only() -> None:
    """A case needing sm_80 kernels kept no CPU check on a T4 or CPU-only runner."""
    case = make_case(Requirements(versions={"capability": ">=8.0"}))
    for env, gpu_reason in [(CPU, "requires capability>=8.0; no accelerator here"),
                            (T4, "requires capability>=8.0; found 7.5 (Tesla T4)")]:
        specs = expand(case, env, saved_dtype="float32")
        assert [(spec.device, spec.skip) for spec in specs] == [("cpu", None),
                                                                ("cuda", gpu_reason)]
    assert [spec.skip for spec in expand(case, CUDA, saved_dtype="float32")] == [None, None]
    assert choose_device(case, T4) == "cpu"
    with pytest.raises(NotRunnable, match=r"--device cuda: requires capability>=8\.0; found 7\.5"):
        choose_device(case, T4, "cuda")


def test_backends_leave_out_the_device_types_none_of_them_has() -> None:
    """backends = ["cpu"] made a CUDA item whose skip advised a GPU runner, where the whole
    case skips; a case's own device list is kept as written."""
    only_cpu = make_case(Requirements(backends=("cpu",)))
    assert ids(expand(only_cpu, CPU, saved_dtype="float32")) == ["cpu-float32"]
    assert {spec.skip for spec in expand(only_cpu, CUDA, saved_dtype="float32")} == {
        "requires backend cpu; this is a CUDA build"}
    rocm = make_case(Requirements(backends=("rocm",)))
    assert ids(expand(rocm, CPU, saved_dtype="float32")) == ["cpu-float32", "cuda-float32"]
    listed = make_case(Requirements(backends=("cpu",), devices=("cpu", "cuda")))
    assert ids(expand(listed, CPU, saved_dtype="float32")) == ["cpu-float32", "cuda-float32"]

# ----------------------------------------------------------------------------- launch blocking


@pytest.mark.parametrize(("env", "variables"), [
    (CUDA, {"CUDA_LAUNCH_BLOCKING": "1"}),
    (ROCM, {"AMD_SERIALIZE_KERNEL": "3"}),
    (MPS, {}),
    (replace(CPU, backend="xpu", device_types=("xpu", "cpu")), {}),
])
@pytest.mark.parametrize("where", ["option", "case"])
def test_launch_blocking_sets_the_backend_variable_on_accelerators_only(
        env: Environment, variables: dict[str, str], where: str) -> None:
    accelerator = next(t for t in env.device_types if t != "cpu")
    case = make_case(Requirements(devices=(accelerator, "cpu")),
                     launch_blocking=where == "case")
    specs = expand(case, env, saved_dtype=None, launch_blocking=where == "option")
    assert [(spec.device, dict(spec.env), spec.launch_blocking) for spec in specs] == [
        (accelerator, variables, bool(variables)), ("cpu", {}, False)]


def test_no_launch_blocking_unless_asked() -> None:
    specs = expand(make_case(Requirements(devices=("cuda",))), CUDA, saved_dtype=None)
    assert [(dict(spec.env), spec.launch_blocking) for spec in specs] == [({}, False)]


def test_runs_do_not_share_their_environment_mapping() -> None:
    case = make_case(Requirements(devices=("cuda",)), VariantTables(batch=AxisSizes(0, (1,))))
    first, second = expand(case, CUDA, saved_dtype=None, launch_blocking=True)
    assert first.env is not second.env
    assert first.env == second.env == {"CUDA_LAUNCH_BLOCKING": "1"}


# --- Build identity: two builds of one version are two environments -----------------------

from pytest_gpucase.plan.environment import package_build  # noqa: E402
from pytest_gpucase.report.file import describe_environment  # noqa: E402
from pytest_gpucase.report.matrix import build_matrix  # noqa: E402
from tests.extension_builds import install_compiled_distribution  # noqa: E402
from tests.helpers import environment as runner_environment  # noqa: E402
from tests.helpers import install_fake_distribution, result  # noqa: E402


@pytest.fixture(scope="module")
def two_builds(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """rowext 2.0 built twice (its compiled module's bytes differ), each in its own site."""
    root = tmp_path_factory.mktemp("builds")
    first = install_compiled_distribution(root / "a", "rowext", "2.0", factor=1.0)
    second = install_compiled_distribution(root / "b", "rowext", "2.0", factor=2.0)
    return first, second


def _build_in(site: Path, monkeypatch: pytest.MonkeyPatch, name: str = "rowext") -> dict | None:
    with monkeypatch.context() as patch:
        patch.syspath_prepend(str(site))
        return package_build(name)


@pytest.mark.slow   # compiles a real extension module
def test_two_builds_of_one_version_have_two_fingerprints(
        two_builds: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    first, second = (_build_in(site, monkeypatch) for site in two_builds)
    assert first is not None and second is not None
    assert first["fingerprint"] != second["fingerprint"]
    assert len(first["fingerprint"]) == 12
    assert first["tag"] == "cp311-cp311-linux_x86_64"
    assert first["torch"] is None   # a build from source says nothing of the torch it used
    # read again: the same (cached per sys.path, and stable)
    assert _build_in(two_builds[0], monkeypatch) == first


def test_a_pure_python_distribution_has_no_build(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    site = install_fake_distribution(tmp_path / "site", "tinyext", "1.0", "tinyext")
    assert _build_in(site, monkeypatch, "tinyext") is None
    assert package_build("not-installed-anywhere") is None


@pytest.mark.slow   # compiles a real extension module
def test_an_editable_build_is_fingerprinted_from_its_files(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # RECORD lists no compiled file (an editable install): the files under the package are read
    first = install_compiled_distribution(tmp_path / "a", "rowedit", "1.0", record=False)
    second = install_compiled_distribution(tmp_path / "b", "rowedit", "1.0", factor=3.0,
                                           record=False)
    found = [_build_in(site, monkeypatch, "rowedit") for site in (first, second)]
    assert all(build is not None for build in found)
    assert found[0]["fingerprint"] != found[1]["fingerprint"]


@pytest.mark.slow   # compiles a real extension module
@pytest.mark.parametrize(("requires", "version", "expected"), [
    ("torch==2.13.0", "2.0", "2.13.0"),
    ("torch>=2.1", "2.0", None),              # a range says nothing of the build's torch
    ("", "2.1.2+pt21cu121", "2.1"),           # PyG's local labels
    ("", "2.0+pt213cpu", "2.13"),
    ("", "2.6.3+cu123torch2.4cxx11abiFALSE", "2.4"),
    ("", "1.0+pt113cu117", "1.13"),
    ("", "1.0+opt2", None),                   # no "pt" label: a word that holds the letters
    ("", "1.0+pt2", None),                    # no minor version: any 2.x
])
def test_the_torch_a_build_was_made_for_is_read_where_it_says_so(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, requires: str, version: str,
        expected: str | None) -> None:
    site = install_compiled_distribution(tmp_path / "site", "rowpin", version, requires=requires)
    build = _build_in(site, monkeypatch, "rowpin")
    assert build is not None and build["torch"] == expected


def _report(env: dict, outcome: str, created: str) -> dict:
    return {"schema": "pytest-gpucase/report", "version": 1, "created": created,
            "environment": env, "complete": True,
            "results": [result("rowcase", "cpu", "float32", outcome,
                               message=None if outcome == "passed" else "outputs differ")]}


def test_two_builds_of_one_version_are_two_columns_never_a_flaky_one() -> None:
    """Two builds of rowext 2.0 (one made for torch 2.9.1, loaded into 2.13) shared one
    column because only the version was recorded: the working build read as flaky or
    failing, whatever the order of the reports."""
    good = runner_environment("2.13.0", None, None, "x", "9.0", packages={"rowext": "2.0"},
                              builds={"rowext": {"fingerprint": "aaaaaaaaaaaa",
                                                 "tag": None, "torch": "2.13"}})
    bad = runner_environment("2.13.0", None, None, "x", "9.0", packages={"rowext": "2.0"},
                             builds={"rowext": {"fingerprint": "bbbbbbbbbbbb",
                                                "tag": None, "torch": "2.9"}})
    for order in ((good, bad), (bad, good)):
        reports = [_report(env, "passed" if env is good else "failed",
                           f"2026-12-0{n + 1}T10:00:00+00:00") for n, env in enumerate(order)]
        matrix = build_matrix(reports, detail=False, names=["one.json", "two.json"])
        assert len(matrix.columns) == 2
        by_label = {column.label: cell.status
                    for column, cell in zip(matrix.columns, matrix.rows[0].cells, strict=True)}
        assert by_label == {"rowext 2.0 (build aaaaaaaaaaaa, for torch 2.13)": "pass",
                            "rowext 2.0 (build bbbbbbbbbbbb, for torch 2.9)": "fail"}
    assert "rowext 2.0 (build aaaaaaaaaaaa, for torch 2.13)" in describe_environment(good)


def test_a_report_without_builds_joins_the_one_column_its_version_fits() -> None:
    # reports written before builds were recorded: same version, no build -> one column
    old = runner_environment("2.13.0", None, None, "x", "9.0", packages={"rowext": "2.0"})
    new = runner_environment("2.13.0", None, None, "x", "9.0", packages={"rowext": "2.0"},
                             builds={"rowext": {"fingerprint": "aaaaaaaaaaaa", "tag": None,
                                                "torch": None}})
    reports = [_report(old, "passed", "2026-12-01T10:00:00+00:00"),
               _report(new, "passed", "2026-12-02T10:00:00+00:00")]
    matrix = build_matrix(reports, detail=False, names=["old.json", "new.json"])
    assert len(matrix.columns) == 1
    assert matrix.columns[0].environment["builds"]["rowext"]["fingerprint"] == "aaaaaaaaaaaa"


# --- The pivot: extension x torch, in version order ---------------------------------------

from pytest_gpucase.report.pivot import (  # noqa: E402
    PivotError,
    pivot,
    render_pivot_html,
    render_pivot_markdown,
)


def _grid_reports(builds: bool = False) -> list[dict]:
    """rowext 1.0 fails, 2.0 passes, on torch 2.13.0, 2.9.1 and 2.14.1, given out of order."""
    reports = []
    for n, (torch_version, rowext) in enumerate([("2.13.0", "2.0"), ("2.9.1", "10.0"),
                                                 ("2.14.1", "1.0"), ("2.9.1", "1.0"),
                                                 ("2.13.0", "1.0"), ("2.14.1", "2.0")]):
        env = runner_environment(torch_version, None, None, "x", "9.0",
                                 packages={"rowext": rowext})
        report = _report(env, "failed" if rowext == "1.0" else "passed",
                         f"2026-12-01T10:00:0{n}+00:00")
        reports.append(report)
    return reports


def test_the_pivot_orders_rows_and_columns_by_version() -> None:
    matrix = build_matrix(_grid_reports(), detail=False)
    view = pivot(matrix, "rowext", "torch")
    assert view.row_values == ("1.0", "2.0", "10.0")        # not "1.0", "10.0", "2.0"
    assert view.column_values == ("2.9.1", "2.13.0", "2.14.1")
    text = render_pivot_markdown(view)
    assert "| rowext \\ torch | **torch 2.9.1** | **torch 2.13.0** | **torch 2.14.1** |" in text
    assert "| **rowext 1.0** | ❌ cpu: fail[^1] | ❌ cpu: fail[^1] | ❌ cpu: fail[^1] |" in text
    assert "| **rowext 10.0** | ✅ cpu: pass | — | — |" in text   # no report: no cell
    assert "| **rowext 2.0** | — | ✅ 1 pass | ✅ 1 pass |" in text   # the all-cases table
    page = render_pivot_html(pivot(matrix, "torch", "rowext"))
    assert page.startswith("<!DOCTYPE html>") and "<style>" in page
    assert "http" not in page.replace("http-equiv", "")   # one self-contained file


def test_two_builds_are_two_values_of_their_axis() -> None:
    env_a = runner_environment("2.13.0", None, None, "x", "9.0", packages={"rowext": "2.0"},
                               builds={"rowext": {"fingerprint": "aaaaaaaaaaaa", "tag": None,
                                                  "torch": "2.13"}})
    env_b = runner_environment("2.13.0", None, None, "x", "9.0", packages={"rowext": "2.0"},
                               builds={"rowext": {"fingerprint": "bbbbbbbbbbbb", "tag": None,
                                                  "torch": "2.9"}})
    matrix = build_matrix([_report(env_a, "passed", "2026-12-01T10:00:00+00:00"),
                           _report(env_b, "failed", "2026-12-01T10:00:01+00:00")], detail=False)
    view = pivot(matrix, "rowext", "torch")
    assert view.row_values == ("2.0 (build aaaaaaaaaaaa, for torch 2.13)",
                               "2.0 (build bbbbbbbbbbbb, for torch 2.9)")


def test_an_axis_no_report_records_is_named_with_the_axes_there_are() -> None:
    matrix = build_matrix(_grid_reports(), detail=False)
    with pytest.raises(PivotError, match=r"no report records 'torh'; axes: torch, .*rowext"):
        pivot(matrix, "rowext", "torh")


def test_the_packages_a_case_file_imports_are_its_call_packages(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """call = "case.py:run" whose case.py imports the extension recorded no package: its
    builds could not tell two columns apart."""
    from pytest_gpucase.plan.environment import call_distributions

    site = install_fake_distribution(tmp_path / "site", "Tiny-Ext", "1.0", "tinyext")
    monkeypatch.syspath_prepend(str(site))
    case = tmp_path / "case"
    case.mkdir()
    (case / "case.py").write_text("from __future__ import annotations\nimport json\n"
                                  "import torch\n\ndef run(x):\n    import tinyext.ops\n"
                                  "    from . import helper\n    return x\n")
    assert call_distributions("case.py:run", case) == ("Tiny-Ext",)
    assert call_distributions("case.py:run") == ()           # no folder to read it from
    assert call_distributions("missing.py:run", case) == ()
    (case / "broken.py").write_text("def run(:\n")
    assert call_distributions("broken.py:run", case) == ()   # the run says what is wrong


def test_each_torch_with_its_own_build_is_no_news_in_a_label_or_a_pivot() -> None:
    """Every torch gets its own build of rowext 2.0 (the usual matrix): torch tells the
    columns apart, so neither the labels nor the pivot name the builds."""
    reports = []
    for n, (torch_version, fingerprint) in enumerate([("2.13.0", "aaaaaaaaaaaa"),
                                                      ("2.9.1", "bbbbbbbbbbbb")]):
        env = runner_environment(torch_version, None, None, "x", "9.0",
                                 packages={"rowext": "2.0"},
                                 builds={"rowext": {"fingerprint": fingerprint, "tag": None,
                                                    "torch": None}})
        reports.append(_report(env, "passed", f"2026-12-01T10:00:0{n}+00:00"))
    matrix = build_matrix(reports, detail=False)
    assert [c.label for c in matrix.columns] == ["torch 2.13.0 · rowext 2.0",
                                                 "torch 2.9.1 · rowext 2.0"]
    view = pivot(matrix, "rowext", "torch")
    assert view.row_values == ("2.0",)
    assert view.column_values == ("2.9.1", "2.13.0")
