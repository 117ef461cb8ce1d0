"""An extension's compatibility matrix on one machine: every torch × extension version in its
own virtual environment (nox makes them), then one merged matrix (docs/ci.md, "Environments
with nox").

    pip install nox
    nox                      # every pair, then the matrix: reports/matrix.html
    nox -s "cases(torch='2.13.0', rowext='2.0')"   # one pair
    nox -s matrix            # merge what is in reports/ again

Edit the three tables below. An extension version is what pip installs: a release
(``rowext==2.0``), a path to a checkout, or a git URL; it is installed with
``--no-build-isolation``, so that a build from source compiles against the torch of its
environment (pip's isolation would build it against a torch it downloads, or fail).
"""

from __future__ import annotations

import os
from pathlib import Path

import nox

EXTENSION = "rowext"
TORCH = ["2.9.1", "2.13.0"]
EXTENSION_VERSIONS = {"1.0": "rowext==1.0", "2.0": "rowext==2.0"}
# What installs gpucase in each environment: the release, or a checkout of it.
GPUCASE = os.environ.get("GPUCASE_SOURCE", "pytest-gpucase")
REPORTS = Path("reports")

nox.options.sessions = ["cases", "matrix"]
nox.options.reuse_existing_virtualenvs = True


@nox.session
@nox.parametrize("rowext", list(EXTENSION_VERSIONS))
@nox.parametrize("torch", TORCH)
def cases(session: nox.Session, torch: str, rowext: str) -> None:
    """The saved cases in one environment; its report in reports/."""
    session.install(f"torch=={torch}", "setuptools", "wheel", GPUCASE)
    session.install("--no-build-isolation", EXTENSION_VERSIONS[rowext])
    REPORTS.mkdir(exist_ok=True)
    report = REPORTS / f"torch{torch}-{EXTENSION}{rowext}.json"
    # A failing case fails the session (exit 1) after its report is written: nox goes on
    # with the next environment, and `matrix` still runs (nox runs every session asked for).
    session.run("pytest", "--gpu-cases", "cases", f"--gpu-require={EXTENSION}",
                f"--gpu-cases-report={report}", "-p", "no:cacheprovider")


@nox.session
def matrix(session: nox.Session) -> None:
    """Every report in reports/ merged: without torch (seconds), as a CI merge job does."""
    session.install("--no-deps", GPUCASE, "packaging")
    reports = sorted(str(path) for path in REPORTS.glob("*.json"))
    if not reports:
        session.error("no report in reports/: run the cases sessions first")
    session.run("gpucase", "matrix", *reports, "--pivot", f"{EXTENSION},torch")
    session.run("gpucase", "matrix", *reports, "--pivot", f"{EXTENSION},torch",
                "--format", "html", "-o", str(REPORTS / "matrix.html"))
