"""Real compiled extensions for the tests of build identity and loader errors: a tiny C
extension module compiled with the system's C compiler, installed as pip leaves a wheel
(a dist-info whose RECORD hashes every file), in a folder put on ``PYTHONPATH``.

Each build takes a fraction of a second; ``compiler`` skips a test where none is found.
"""

from __future__ import annotations

import base64
import hashlib
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest

__all__ = ["MODULE_SOURCE", "compile_extension", "compiler", "install_compiled_distribution"]

# The package's Python side: ``pool`` scales by what the compiled module says (1.0 is right).
MODULE_SOURCE = ("from . import _C\n\n\n"
                 "def pool(x, mask):\n"
                 "    return x * _C.factor()\n")

_C_SOURCE = r"""
#include <Python.h>
#ifdef NEEDS_TORCH_SYMBOL
/* What an extension built against another torch asks the loader for. */
extern void _ZN5torch7Library4_defEPKc(const char *);
#endif
#ifdef NEEDS_LIBRARY
extern int gpucase_missing_dependency(void);
#endif
static PyObject *factor(PyObject *self, PyObject *args) { return PyFloat_FromDouble(FACTOR); }
static PyMethodDef methods[] = {{"factor", factor, METH_NOARGS, ""}, {NULL, NULL, 0, NULL}};
static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", NULL, -1, methods};
PyMODINIT_FUNC PyInit__C(void) {
#ifdef NEEDS_TORCH_SYMBOL
    _ZN5torch7Library4_defEPKc("x");
#endif
#ifdef NEEDS_LIBRARY
    gpucase_missing_dependency();
#endif
    return PyModule_Create(&module);
}
"""


def compiler() -> str:
    """The C compiler's path; the test is skipped where there is none."""
    found = shutil.which("cc") or shutil.which("gcc")
    if found is None:
        pytest.skip("needs a C compiler (cc or gcc) to build a real extension module")
    return found


def compile_extension(folder: Path, *, factor: float = 1.0, defines: tuple[str, ...] = ()) -> Path:
    """``folder/_C<EXT_SUFFIX>``, an extension module whose ``factor()`` returns ``factor``.

    ``NEEDS_TORCH_SYMBOL`` makes it need a symbol of torch's C++ API that nothing defines
    (the loader refuses it as it refuses a build for another torch); ``NEEDS_LIBRARY`` a
    shared library that is gone by the time it loads.
    """
    cc = compiler()
    folder.mkdir(parents=True, exist_ok=True)
    source = folder / "_C.c"
    source.write_text(_C_SOURCE)
    target = folder / f"_C{sysconfig.get_config_var('EXT_SUFFIX')}"
    command = [cc, "-shared", "-fPIC", "-O0", f"-DFACTOR={factor!r}",
               *(f"-D{define}" for define in defines),
               f"-I{sysconfig.get_paths()['include']}", "-o", str(target), str(source)]
    if "NEEDS_LIBRARY" in defines:
        library = folder / "libgpucase_missing.so"
        helper = folder / "missing.c"
        helper.write_text("int gpucase_missing_dependency(void) { return 0; }\n")
        subprocess.run([cc, "-shared", "-fPIC", "-o", str(library), str(helper)], check=True)
        command += [f"-L{folder}", "-lgpucase_missing"]
    subprocess.run(command, check=True, capture_output=True)
    source.unlink()
    if "NEEDS_LIBRARY" in defines:
        (folder / "libgpucase_missing.so").unlink()   # gone: the loader cannot open it
        (folder / "missing.c").unlink()
    return target


def _record_hash(data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
    return f"sha256={digest.decode()}"


def install_compiled_distribution(site: Path, name: str, version: str, *, factor: float = 1.0,
                                  defines: tuple[str, ...] = (), requires: str = "",
                                  record: bool = True) -> Path:
    """Install ``name`` (module of the same name) as pip leaves a wheel: the package with its
    compiled ``_C``, a dist-info with METADATA, WHEEL, top_level.txt and a RECORD of every
    file with its hash; ``record=False`` lists no compiled file there (an editable install
    keeps them in the source tree)."""
    package = site / name
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(MODULE_SOURCE)
    compiled = compile_extension(package, factor=factor, defines=defines)
    info = site / f"{name}-{version}.dist-info"
    info.mkdir()
    metadata = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
    if requires:
        metadata += f"Requires-Dist: {requires}\n"
    (info / "METADATA").write_text(metadata)
    (info / "WHEEL").write_text("Wheel-Version: 1.0\nRoot-Is-Purelib: false\n"
                                "Tag: cp311-cp311-linux_x86_64\n")
    (info / "top_level.txt").write_text(name + "\n")
    files = [package / "__init__.py", info / "METADATA", info / "WHEEL", info / "top_level.txt"]
    if record:
        files.append(compiled)
    lines = [f"{path.relative_to(site).as_posix()},{_record_hash(path.read_bytes())},"
             f"{path.stat().st_size}" for path in files]
    lines.append(f"{name}-{version}.dist-info/RECORD,,")
    (info / "RECORD").write_text("\n".join(lines) + "\n")
    return site
