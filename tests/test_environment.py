"""The environment snapshot: probed for real in a child, and read back as one header line."""

from __future__ import annotations

import json
import pickle
import platform
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from pytest_gpucase.plan.environment import (
    Device,
    Environment,
    call_distributions,
    canonical_name,
    dnn_library,
    git_revision,
    package_version,
    probe_here,
)
from pytest_gpucase.base.backends import launch_blocking_env
from pytest_gpucase.run.probe import probe
from tests.helpers import install_fake_distribution

H100 = Device(0, "NVIDIA H100 80GB HBM3", "9.0", 79.1)
CUDA = Environment(backend="cuda", device_types=("cuda", "cpu"),
                   devices=(H100, Device(1, "NVIDIA H100 80GB HBM3", "9.0", 79.1)),
                   torch="2.4.0+cu124", cuda="12.4", cudnn="90100", python="3.11.7",
                   revision="3f2c1ab")
CPU_ONLY_BUILD = torch.version.cuda is None and getattr(torch.version, "hip", None) is None
needs_cpu_only_build = pytest.mark.skipif(
    not CPU_ONLY_BUILD, reason="the expected values are those of a CPU-only torch build")


# ----------------------------------------------------------------------------- the probe


def build_backend() -> str:
    """The backend this torch build was made for, read without touching any device."""
    if getattr(torch.version, "hip", None):
        return "rocm"
    if torch.version.cuda:
        return "cuda"
    if getattr(torch.version, "xpu", None):
        return "xpu"
    return "mps" if torch.backends.mps.is_built() else "cpu"


@pytest.mark.slow
def test_probe_runs_in_a_child_and_leaves_cuda_alone() -> None:
    env = probe(["pytest", "no-such-distribution-gpucase"], rootdir=None)
    assert env.backend == build_backend()
    assert env.device_types[-1] == "cpu"
    assert env.torch == torch.__version__
    assert (env.cuda, env.hip) == (torch.version.cuda, getattr(torch.version, "hip", None))
    assert env.python == platform.python_version()
    assert env.packages == {"no-such-distribution-gpucase": None, "pytest": pytest.__version__}
    assert env.revision is None
    cuda_initialized: Callable[[], bool] = torch.cuda.is_initialized
    assert not cuda_initialized()


@pytest.mark.slow
@needs_cpu_only_build
def test_probe_of_a_cpu_only_build() -> None:
    env = probe()
    if env.backend == "cpu":
        assert (env.device_types, env.devices) == (("cpu",), ())
    assert (env.cuda, env.hip, env.cudnn, env.packages) == (None, None, None, {})
    # Here nothing can reach a device, so the snapshot may be taken in this process too.
    assert probe_here() == env


def test_package_versions_come_from_the_installed_metadata() -> None:
    assert package_version("pytest") == pytest.__version__
    assert package_version("PyTest") == pytest.__version__     # names compare as pip's do
    assert package_version("no-such-distribution-gpucase") is None
    assert package_version("") is None


# ----------------------------------------------------------------------------- git revision


def git(cwd: Path, *args: str) -> str:
    done = subprocess.run(
        ["git", "-c", "user.name=gpucase", "-c", "user.email=gpucase@example.invalid",
         "-c", "commit.gpgsign=false", "-c", "tag.gpgsign=false", "-c", "init.defaultBranch=main",
         *args],
        cwd=cwd, capture_output=True, text=True, check=True)
    return done.stdout.strip()


@pytest.fixture
def repo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A git repository with one commit of ``train.py``; no repository above it is looked for."""
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))
    for name in ("GIT_DIR", "GIT_WORK_TREE", "GIT_INDEX_FILE"):
        monkeypatch.delenv(name, raising=False)
    path = tmp_path / "project"
    path.mkdir()
    git(path, "init", "-q")
    (path / "train.py").write_text("print('step')\n")
    git(path, "add", "train.py")
    git(path, "commit", "-q", "-m", "first")
    return path


@pytest.mark.slow
def test_git_revision_is_the_short_commit(repo: Path) -> None:
    commit = git(repo, "rev-parse", "HEAD")
    revision = git_revision(str(repo))
    assert revision is not None
    assert len(revision) >= 7 and commit.startswith(revision)
    (repo / "sub").mkdir()
    assert git_revision(str(repo / "sub")) == revision


@pytest.mark.slow
def test_git_revision_is_dirty_after_a_change_to_a_tracked_file(repo: Path) -> None:
    clean = git_revision(str(repo))
    (repo / "notes.txt").write_text("untracked files do not count\n")
    assert git_revision(str(repo)) == clean
    (repo / "train.py").write_text("print('changed')\n")
    assert git_revision(str(repo)) == f"{clean}-dirty"
    git(repo, "add", "train.py")
    assert git_revision(str(repo)) == f"{clean}-dirty"           # staged is changed too
    git(repo, "commit", "-q", "-m", "second")
    assert git_revision(str(repo)) == git(repo, "rev-parse", "--short=7", "HEAD")


@pytest.mark.slow
def test_git_revision_names_the_commit_even_when_it_is_tagged(repo: Path) -> None:
    git(repo, "tag", "-a", "v1.0", "-m", "release")
    assert git_revision(str(repo)) == git(repo, "rev-parse", "--short=7", "HEAD")


@pytest.mark.slow
def test_no_revision_outside_a_repository(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))
    assert git_revision(str(tmp_path)) is None
    assert git_revision(str(tmp_path / "missing")) is None
    assert git_revision(None) is None


@pytest.mark.slow
def test_no_revision_before_the_first_commit(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))
    git(tmp_path, "init", "-q")
    assert git_revision(str(tmp_path)) is None


@pytest.mark.slow
def test_the_probe_records_the_revision(repo: Path) -> None:
    assert probe(rootdir=str(repo)).revision == git_revision(str(repo))


# ----------------------------------------------------------------------------- header


def test_header_of_a_cpu_environment() -> None:
    env = Environment(backend="cpu", device_types=("cpu",), torch="2.13.0+cpu", python="3.11.7",
                      revision="3f2c1ab-dirty")
    assert env.header() == (
        "gpucase: cpu backend · torch 2.13.0+cpu · Python 3.11.7 · no accelerator: CPU items "
        "only (a CPU pass is a hint, not GPU validation) · rev 3f2c1ab-dirty")


def test_header_of_a_cuda_environment_with_two_devices() -> None:
    assert CUDA.header() == (
        "gpucase: cuda backend · torch 2.4.0+cu124 · CUDA 12.4 · cuDNN 9.1.0 · Python 3.11.7 · "
        "2 × NVIDIA H100 80GB HBM3 (9.0) · rev 3f2c1ab")


def test_header_counts_each_kind_of_device() -> None:
    env = Environment(backend="cuda", device_types=("cuda", "cpu"), torch="2.3.1+cu121",
                      cuda="12.1", cudnn="8902", python="3.10.14", devices=(
                          Device(0, "NVIDIA A100-SXM4-80GB", "8.0"), Device(1, "Tesla T4", "7.5"),
                          Device(2, "NVIDIA A100-SXM4-80GB", "8.0")))
    assert env.header() == (
        "gpucase: cuda backend · torch 2.3.1+cu121 · CUDA 12.1 · cuDNN 8.9.2 · Python 3.10.14 · "
        "2 × NVIDIA A100-SXM4-80GB (8.0) + 1 × Tesla T4 (7.5)")


def test_header_of_a_rocm_environment() -> None:
    env = Environment(backend="rocm", device_types=("cuda", "cpu"), torch="2.3.0+rocm6.0",
                      hip="6.0.32830-d62f6a171", cudnn="3001000", python="3.11.7",
                      devices=tuple(Device(i, "AMD Instinct MI250X", "gfx90a:sramecc+:xnack-")
                                    for i in range(8)))
    assert env.header() == (
        "gpucase: rocm backend · torch 2.3.0+rocm6.0 · HIP 6.0.32830-d62f6a171 · MIOpen 3.1.0 · "
        "Python 3.11.7 · 8 × AMD Instinct MI250X (gfx90a:sramecc+:xnack-)")


def test_header_of_a_cuda_build_without_a_gpu() -> None:
    env = Environment(backend="cuda", device_types=("cpu",), torch="2.4.0+cu124", cuda="12.4",
                      cudnn="90100", python="3.11.7")
    assert env.header() == (
        "gpucase: cuda backend · torch 2.4.0+cu124 · CUDA 12.4 · cuDNN 9.1.0 · Python 3.11.7 · "
        "no accelerator: CPU items only (a CPU pass is a hint, not GPU validation)")


def test_header_without_torch_and_with_a_device_of_no_capability() -> None:
    env = Environment(backend="mps", device_types=("mps", "cpu"), devices=(Device(0, "Apple MPS"),),
                      python="3.12.1")
    assert env.header() == (
        "gpucase: mps backend · torch not installed · Python 3.12.1 · 1 × Apple MPS")


@pytest.mark.parametrize(("cudnn", "backend", "shown"), [
    ("90100", "cuda", "cuDNN 9.1.0"),
    ("91000", "cuda", "cuDNN 9.10.0"),
    ("90501", "cuda", "cuDNN 9.5.1"),
    ("8902", "cuda", "cuDNN 8.9.2"),
    ("8700", "cuda", "cuDNN 8.7.0"),
    ("7605", "cuda", "cuDNN 7.6.5"),
    ("3001000", "rocm", "MIOpen 3.1.0"),
    ("2019000", "rocm", "MIOpen 2.19.0"),
    ("9.1.0", "cuda", "cuDNN 9.1.0"),
    (None, "cuda", None),
    ("", "cuda", None),
])
def test_dnn_library_writes_the_version_out(cudnn: str | None, backend: str,
                                            shown: str | None) -> None:
    assert dnn_library(cudnn, backend) == shown


def test_the_snapshot_crosses_process_and_file_boundaries() -> None:
    assert pickle.loads(pickle.dumps(CUDA)) == CUDA
    data = json.loads(json.dumps(CUDA.to_dict()))
    assert data["devices"][1] == {"index": 1, "name": "NVIDIA H100 80GB HBM3",
                                  "capability": "9.0", "memory_gib": 79.1}
    assert (data["backend"], data["cudnn"], data["revision"]) == ("cuda", "90100", "3f2c1ab")


# ----------------------------------------------------------------------------- launch blocking


@pytest.mark.parametrize(("backend", "variables"), [
    ("cuda", {"CUDA_LAUNCH_BLOCKING": "1"}),
    ("rocm", {"AMD_SERIALIZE_KERNEL": "3"}),
    ("mps", {}),
    ("xpu", {}),
    ("cpu", {}),
])
def test_launch_blocking_env(backend: str, variables: dict[str, str]) -> None:
    assert launch_blocking_env(backend) == variables


def test_the_distribution_a_call_imports_is_found_without_importing_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    site = install_fake_distribution(tmp_path / "site", "Tiny-Ext", "1.0", "tinyext")
    assert call_distributions("tinyext:pool") == ()   # not on sys.path yet
    monkeypatch.syspath_prepend(str(site))
    # the cache is per sys.path: a changed path is read again
    assert call_distributions("tinyext:pool") == ("Tiny-Ext",)
    assert call_distributions("tinyext.sub.mod:pool") == ("Tiny-Ext",)
    assert "tinyext" not in sys.modules   # looked up in metadata, never imported
    assert call_distributions("pytest:main") == ("pytest",)
    for call in ("case.py:run", "helpers/ops.py:run",   # the case's own file
                 "os.path:join", "json:loads",          # the standard library
                 "torch.nn.functional:cross_entropy",   # recorded already
                 "pytest_gpucase.capture:replay_module",  # the writer, recorded as gpucase
                 "not_installed_anywhere:f"):           # the project's own, or nothing
        assert call_distributions(call) == (), call
    assert canonical_name("Flash_Attn") == canonical_name("flash.attn") == "flash-attn"


def test_unreadable_metadata_of_some_distribution_records_no_call_package(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A latin-1 METADATA or a RECORD row of four fields somewhere on sys.path raised from
    packages_distributions() for every item: INTERNALERROR, no result."""
    from importlib import metadata

    from pytest_gpucase.plan import environment

    def broken() -> dict[str, list[str]]:
        raise UnicodeDecodeError("utf-8", b"\xe9", 0, 1, "invalid continuation byte")

    monkeypatch.setattr(metadata, "packages_distributions", broken)
    environment._distributions_by_module.cache_clear()
    try:
        assert call_distributions("tinyext:pool") == ()
    finally:
        environment._distributions_by_module.cache_clear()


def test_a_case_file_without_third_party_imports_reads_no_installed_metadata(
        tmp_path: Path) -> None:
    """Reading every installed distribution's metadata costs 0.1 s (paid by a session's
    first item): a case's own file that imports only the standard library needs none."""
    from pytest_gpucase.plan import environment

    (tmp_path / "case.py").write_text("import math\n\n\ndef run(x):\n    return x + 1\n")
    environment._distributions_by_module.cache_clear()
    try:
        assert call_distributions("case.py:run", tmp_path) == ()
        assert environment._distributions_by_module.cache_info().misses == 0
        (tmp_path / "case.py").write_text("import pytest\n\n\ndef run(x):\n    return x\n")
        assert call_distributions("case.py:run", tmp_path) == ("pytest",)
        assert environment._distributions_by_module.cache_info().misses == 1
    finally:
        environment._distributions_by_module.cache_clear()


def test_a_case_files_imports_are_found_in_every_statement_position(tmp_path: Path) -> None:
    """Imports are statements: each place a statement can stand is read (a function's or a
    class's body, every branch of if, for, while, with, try and match), in the file's order;
    a relative import and a name inside an expression are not imports of a distribution."""
    from pytest_gpucase.plan.environment import _file_imports

    source = tmp_path / "case.py"
    source.write_text(
        "import top_a, top_b.sub\n"
        "from top_c.x import y\n"
        "from . import local\n"
        "def f():\n    import in_def\n    class C:\n        import in_class\n"
        "async def g():\n    async with h():\n        import in_async_with\n"
        "if X:\n    import in_if\nelif Y:\n    import in_elif\nelse:\n    import in_else\n"
        "for i in []:\n    import in_for\nelse:\n    import in_for_else\n"
        "while False:\n    import in_while\nelse:\n    import in_while_else\n"
        "with ctx():\n    import in_with\n"
        "try:\n    import in_try\nexcept ImportError:\n    import in_except\n"
        "else:\n    import in_try_else\nfinally:\n    import in_finally\n"
        "match v:\n    case 1:\n        import in_case\n"
        "z = __import__('not_a_statement'); s = 'import not_code'\n")
    assert _file_imports(source) == (
        "top_a", "top_b", "top_c", "in_def", "in_class", "in_async_with", "in_if", "in_elif",
        "in_else", "in_for", "in_for_else", "in_while", "in_while_else", "in_with", "in_try",
        "in_except", "in_try_else", "in_finally", "in_case")
