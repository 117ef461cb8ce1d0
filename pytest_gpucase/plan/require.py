"""Packages a run demands (``--gpu-require``, the ini key ``gpu_require``): checked at the start
of the session, so that a runner missing the extension it exists to test fails instead of
skipping every case and passing.

Pure: the installed versions are read from the distributions' metadata, nothing is imported.
"""

from __future__ import annotations

from collections.abc import Iterable

from packaging.requirements import InvalidRequirement, Requirement
from packaging.version import InvalidVersion, Version

from pytest_gpucase.plan.environment import package_version

__all__ = ["required_names", "unmet_requirement"]


def required_names(demanded: Iterable[str]) -> tuple[str, ...]:
    """The distributions ``demanded`` names here (those whose marker holds; an entry that is
    no requirement is left to ``unmet_requirement`` to name): what a run's report records
    the version and build of, whatever the cases import them through (the project's own
    package), so that two builds of an extension never share a column."""
    names: dict[str, None] = {}
    for text in demanded:
        try:
            requirement = Requirement(text)
        except InvalidRequirement:
            continue
        if requirement.marker is None or requirement.marker.evaluate():
            names[requirement.name] = None
    return tuple(names)


def unmet_requirement(demanded: Iterable[str], source: str = "--gpu-require") -> str | None:
    """One line naming the first demanded package that is missing or outside its range, or
    None when every one is met.

    Each entry is a requirement as pip reads it (``rowext``, ``rowext>=2,<3``,
    ``flash-attn>=2.5; platform_system == "Linux"``: one whose marker is false here is not
    demanded). A pre-release or local version (``2.0+pt213cu121``) counts as its version.
    An entry that is no requirement is named with the fix.
    """
    for text in demanded:
        try:
            requirement = Requirement(text)
        except InvalidRequirement as exc:
            return (f"{source}: {text!r} is not a requirement ({exc}); write a distribution "
                    "name with an optional version range, e.g. rowext>=2")
        if requirement.marker is not None and not requirement.marker.evaluate():
            continue
        found = package_version(requirement.name)
        if found is None:
            return (f"{source} {text}: {requirement.name} is not installed in this environment "
                    f"({_interpreter()}); install it, or leave it out where it is not expected")
        if not requirement.specifier:
            continue
        try:
            met = requirement.specifier.contains(Version(found), prereleases=True)
        except InvalidVersion:
            met = requirement.specifier.contains(found, prereleases=True)
        if not met:
            return (f"{source} {text}: {requirement.name} {found} is installed, outside "
                    f"{requirement.specifier} ({_interpreter()})")
    return None


def _interpreter() -> str:
    import sys

    return f"Python at {sys.executable}"
