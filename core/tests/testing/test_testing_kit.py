"""The conformance kit's selection checks fail a backend that breaks what they check."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

import cardcage
from cardcage.backend.accelerator import Resolution
from cardcage.testing.selection_checks import SelectionChecks


class Bare(cardcage.Accelerator):
    """Refuses a named job with an error that tells the user nothing to change."""

    name = "bare"

    @classmethod
    def resolve(cls, ctx: Any) -> Resolution:
        raise cardcage.MisconfigurationError("this job cannot run here, for reasons of its own")


class Suite(SelectionChecks):
    backend = "bare"


def test_an_error_that_names_no_flag_fails_the_rule_matrix(
    inprocess_accelerators: Callable[..., None],
) -> None:
    """An error of more than 20 characters used to pass; one must name a flag or variable."""
    inprocess_accelerators("bare", Bare)
    with pytest.raises(AssertionError, match="the error names none of"):
        Suite().test_rule_matrix("plain")
