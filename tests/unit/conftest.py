"""Fixtures shared by the unit tests: ``model`` and ``tok`` are minienv's bundled model and tokenizer, loaded once.

A module that wants a small random model instead defines its own ``model`` / ``tok`` fixture, which overrides these.
"""

from __future__ import annotations

import pytest

from engine_harness import bundled


@pytest.fixture(scope="session")
def model():
    return bundled()[0]


@pytest.fixture(scope="session")
def tok():
    return bundled()[1]
