"""`interval_from_env`: the CLI value, else DFLASH_PROFILE_INTERVAL; a bad one is one line, not a crash."""

from __future__ import annotations

import pytest

from dflash_cache.errors import UserError
from dflash_cache.profiler import ENV_VAR, interval_from_env


def test_cli_value_wins_and_unset_means_off(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert interval_from_env(None) is None
    monkeypatch.setenv(ENV_VAR, "  ")
    assert interval_from_env(None) is None
    monkeypatch.setenv(ENV_VAR, "2.5")
    assert interval_from_env(None) == 2.5
    assert interval_from_env(7) == 7.0


@pytest.mark.parametrize("value", ["abc", "0", "-3", "nan", "inf"])
def test_bad_environment_value_is_one_line(monkeypatch, value):
    monkeypatch.setenv(ENV_VAR, value)
    with pytest.raises(UserError, match=f"^{ENV_VAR}='{value}'") as info:
        interval_from_env(None)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("value", [0, -1.0, float("nan")])
def test_bad_cli_value_is_one_line(monkeypatch, value):
    monkeypatch.delenv(ENV_VAR, raising=False)
    with pytest.raises(UserError, match="^--profile-interval: the interval must be a positive number of seconds"):
        interval_from_env(value)
