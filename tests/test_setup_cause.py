"""A case that cannot be set up carries its cause's type (``Outcome.cause_type``) to the
parent, and the item's advice on a missing module reads that, not the message's words."""

from __future__ import annotations

from pytest_gpucase.plugin.items import _missing_module
from pytest_gpucase.run.isolation.wire import decode, encode
from pytest_gpucase.run.outcome import CaseSetupError, Outcome, raised


def _setup_failure(cause: BaseException) -> Outcome:
    try:
        try:
            raise cause
        except Exception as exc:
            raise CaseSetupError(f"importing mymodel:make failed ({type(exc).__name__}: "
                                 f"{exc}); the case's call never ran") from exc
    except CaseSetupError as failed:
        return raised("the call", failed)


def test_a_missing_module_is_told_by_the_cause_s_type_across_the_wire() -> None:
    outcome = decode(encode(_setup_failure(ModuleNotFoundError("No module named 'fakefw.x'",
                                                               name="fakefw.x"))))
    assert outcome.error_type == "CaseSetupError"
    assert outcome.cause_type == "ModuleNotFoundError"
    assert _missing_module(outcome) == "fakefw"


def test_a_cause_that_quotes_a_missing_module_is_not_taken_for_one() -> None:
    """A RuntimeError whose words hold another error's text is not a missing module: the
    case is broken, and installing a package would not fix it."""
    outcome = _setup_failure(RuntimeError(
        "plugin loader gave up (ModuleNotFoundError: No module named 'fakefw')"))
    assert outcome.cause_type == "RuntimeError"
    assert _missing_module(outcome) is None


def test_an_outcome_without_the_cause_falls_back_on_its_message() -> None:
    outcome = Outcome("failed", "the call could not be set up", error_type="CaseSetupError",
                      error_message="importing m failed (ModuleNotFoundError: No module "
                                    "named 'fakefw')", kind="broken case")
    assert _missing_module(outcome) == "fakefw"
