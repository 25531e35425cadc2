"""Test tiers (see README): unit and notebook tests always run; `reference` and `browser` tests skip when their
dependencies are missing. With MINIENV_REQUIRE_TIERS=1 (CI, `MINIENV_TIERS=all make test`) a skipped
reference or browser test fails the run instead, so CI can never go green by silently skipping a tier."""

from __future__ import annotations

import os

import pytest

REQUIRED_TIERS = ("reference", "browser")
_skipped_in_required_tier: list[str] = []


def require_tiers() -> bool:
    return os.environ.get("MINIENV_REQUIRE_TIERS") == "1"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.skipped and require_tiers():
        tiers = [t for t in REQUIRED_TIERS if item.get_closest_marker(t)]
        if tiers:
            _skipped_in_required_tier.append(f"{item.nodeid} ({tiers[0]} tier): {report.longrepr}")


def pytest_sessionfinish(session, exitstatus):
    if _skipped_in_required_tier:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter):
    if _skipped_in_required_tier:
        terminalreporter.section("required test tiers were skipped (MINIENV_REQUIRE_TIERS=1)", red=True)
        for line in _skipped_in_required_tier:
            terminalreporter.line(line)
