"""Profiles are registered in one place and chosen explicitly, never left to Hypothesis's own ci profile."""

import pytest
from hypothesis import settings

from kvprop.errors import ConfigError
from kvprop.search import profiles


def test_every_profile_sets_deadline_and_health_checks_itself():
    profiles.register()
    for name in profiles.PROFILES:
        p = settings.get_profile(name)
        assert p.deadline is None
        assert set(profiles.QUIET_CHECKS) <= set(p.suppress_health_check)


def test_ci_profile_is_derandomized_and_fuzz_profile_saves_examples():
    profiles.register()
    assert settings.get_profile("ci").derandomize
    assert settings.get_profile("ci").database is None
    assert not settings.get_profile("fuzz").derandomize
    assert settings.get_profile("fuzz").database is not None


def test_unknown_profile_is_an_error_that_lists_the_known_ones(monkeypatch):
    monkeypatch.setenv(profiles.ENV, "nightly")
    with pytest.raises(ConfigError, match="unknown Hypothesis profile 'nightly'.*dev, ci, fuzz, repro"):
        profiles.load()


def test_the_environment_selects_the_profile(monkeypatch):
    current = settings._current_profile
    monkeypatch.setenv(profiles.ENV, "repro")
    try:
        assert profiles.load() == "repro"
        assert settings.default.max_examples == 1
    finally:
        settings.load_profile(current)
