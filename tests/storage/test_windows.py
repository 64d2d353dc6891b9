"""The completion-window settings: the default set, how windows and price multipliers are
spelled, and a malformed value refused when the settings load (so at a process's start-up)."""

from __future__ import annotations

from decimal import Decimal

import pytest
from pydantic import ValidationError

from backfill.storage.settings import Settings, parse_duration, parse_multipliers, parse_windows

HOUR, DAY = 3600, 86400


def _defaults(monkeypatch: pytest.MonkeyPatch) -> Settings:
    for name in ("BACKFILL_COMPLETION_WINDOWS", "BACKFILL_WINDOW_PRICE_MULTIPLIERS"):
        monkeypatch.delenv(name, raising=False)
    return Settings(_env_file=None)  # type: ignore[call-arg]


def test_the_default_set_and_its_prices(monkeypatch: pytest.MonkeyPatch) -> None:
    settings = _defaults(monkeypatch)
    assert settings.completion_windows == {
        "1h": HOUR,
        "4h": 4 * HOUR,
        "24h": DAY,
        "72h": 3 * DAY,
        "7d": 7 * DAY,
    }
    multipliers = settings.window_price_multipliers
    assert multipliers == {"1h": 2, "4h": Decimal("1.5"), "24h": 1, "72h": Decimal("0.8"), "7d": Decimal("0.6")}
    # Shorter windows cost more.
    ordered = [multipliers[w] for w in settings.completion_windows]
    assert ordered == sorted(ordered, reverse=True)


@pytest.mark.parametrize(
    ("text", "seconds"), [("90s", 90), ("30m", 1800), ("4h", 4 * HOUR), ("72h", 3 * DAY), ("7d", 7 * DAY)]
)
def test_durations(text: str, seconds: int) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "h", "0h", "-1h", "1.5h", "1H", "1w", "24", " 1h", "１h", "1h30m"])
def test_bad_durations(text: str) -> None:
    with pytest.raises(ValueError, match="bad duration"):
        parse_duration(text)


def test_windows_are_sorted_shortest_first_and_24h_is_always_in() -> None:
    assert parse_windows(" 7d, 90m ,,2h") == {"90m": 5400, "2h": 2 * HOUR, "24h": DAY, "7d": 7 * DAY}
    assert parse_windows("") == {"24h": DAY}
    assert parse_windows("24h,1d") == {"1d": DAY, "24h": DAY}  # two names, each accepted as spelled


@pytest.mark.parametrize(
    ("text", "error"),
    [("1h,banana", "bad duration"), ("1h,1h", "listed twice"), ("12345678901234567h", "longer than 16")],
)
def test_bad_window_sets(text: str, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        parse_windows(text)


def test_multipliers() -> None:
    assert parse_multipliers("1h=2, 7d = 0.6,") == {"1h": Decimal(2), "7d": Decimal("0.6")}
    assert parse_multipliers("") == {}


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("1h", "use window=multiplier"),
        ("1h=abc", "not a decimal"),
        ("1h=0", "must be positive"),
        ("1h=-2", "must be positive"),
        ("1h=nan", "must be positive"),
        ("1h=2,1h=3", "two price multipliers"),
        ("soon=2", "bad duration"),
    ],
)
def test_bad_multipliers(text: str, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        parse_multipliers(text)


@pytest.mark.parametrize(
    ("name", "value"),
    [("BACKFILL_COMPLETION_WINDOWS", "1h,soon"), ("BACKFILL_WINDOW_PRICE_MULTIPLIERS", "1h=cheap")],
)
def test_a_malformed_setting_fails_when_the_settings_load(
    monkeypatch: pytest.MonkeyPatch, name: str, value: str
) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(ValidationError, match=name.removeprefix("BACKFILL_").lower()):
        Settings(_env_file=None)  # type: ignore[call-arg]
