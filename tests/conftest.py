"""Test tiers (see README): unit and notebook tests always run; `reference`, `browser`, `redis` and `prometheus`
tests skip when their dependencies are missing (`redis`: Debian's redis-server binary; `prometheus`: Debian's
prometheus binary); `install` tests (they create a venv and pip-install from the network, e.g. `make lab`) skip
unless MINIENV_INSTALL_TESTS=1. With MINIENV_REQUIRE_TIERS=1 (CI, `MINIENV_TIERS=all make test`, both of which also
set MINIENV_INSTALL_TESTS=1) a skipped reference, browser, redis, prometheus or install test fails the run instead,
so CI can never go green by silently skipping a tier.

The install tier is switched on by an environment variable, not by `-m`: a user's own `-m` expression would replace
an `addopts` one and silently start installing, and a plain `pytest` must never touch the network."""

from __future__ import annotations

import os

import pytest

REQUIRED_TIERS = ("reference", "browser", "install", "redis", "prometheus", "binder", "realmodel")
_skipped_in_required_tier: list[str] = []


def require_tiers() -> bool:
    return os.environ.get("MINIENV_REQUIRE_TIERS") == "1"


def install_tests_enabled() -> bool:
    return os.environ.get("MINIENV_INSTALL_TESTS") == "1"


def pytest_collection_modifyitems(config, items):
    if install_tests_enabled():
        return
    skip = pytest.mark.skip(reason="install tier: creates a venv and installs from the network; "
                                   "set MINIENV_INSTALL_TESTS=1 to run it (CI does)")
    for item in items:
        if item.get_closest_marker("install"):
            item.add_marker(skip)


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
