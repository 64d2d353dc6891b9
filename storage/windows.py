"""Completion windows and their price multipliers as the settings spell them.

`BACKFILL_COMPLETION_WINDOWS` ("1h,4h,24h,72h,7d") is the set `completion_window` accepts, and
`BACKFILL_WINDOW_PRICE_MULTIPLIERS` ("1h=2.0,24h=1.0,...") what a window costs relative to a
model's general price (`jobs.billing.window_rates`). Both are parsed when the settings load, so a
malformed value stops a process at start-up instead of failing the first request that reads it.
"""

from __future__ import annotations

from decimal import Decimal, InvalidOperation

# OpenAI's one window: always accepted, whatever the setting says, since every OpenAI client
# (the official SDK types the parameter as Literal["24h"]) sends it.
OPENAI_WINDOW = "24h"
MAX_WINDOW_NAME = 16  # batches.completion_window and prices.completion_window are String(16)
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str) -> int:
    """'90s', '30m', '4h', '7d' -> seconds: a positive integer and one unit, nothing else."""
    unit, number = text[-1:], text[:-1]
    if unit not in _UNITS or not (number.isascii() and number.isdigit()) or int(number) <= 0:
        raise ValueError(f"bad duration {text!r}: use a positive integer and one of s, m, h, d")
    return int(number) * _UNITS[unit]


def parse_windows(text: str) -> dict[str, int]:
    """'1h,4h,24h' -> {'1h': 3600, '4h': 14400, '24h': 86400}, shortest first; OpenAI's 24h is
    always in. A window is accepted by exactly the name configured ('1d' does not accept '24h')."""
    windows = {OPENAI_WINDOW: parse_duration(OPENAI_WINDOW)}
    seen: set[str] = set()
    for raw in text.split(","):
        name = raw.strip()
        if not name:
            continue
        if name in seen:
            raise ValueError(f"completion window {name!r} is listed twice")
        if len(name) > MAX_WINDOW_NAME:
            raise ValueError(f"completion window {name!r} is longer than {MAX_WINDOW_NAME} characters")
        seen.add(name)
        windows[name] = parse_duration(name)
    return dict(sorted(windows.items(), key=lambda item: (item[1], item[0])))


def parse_multipliers(text: str) -> dict[str, Decimal]:
    """'1h=2.0,7d=0.6' -> {'1h': Decimal('2.0'), '7d': Decimal('0.6')}: positive decimals, keyed by
    window name (a name the window set does not hold is allowed and unused)."""
    multipliers: dict[str, Decimal] = {}
    for raw in text.split(","):
        item = raw.strip()
        if not item:
            continue
        name, sep, value = (part.strip() for part in item.partition("="))
        if not sep:
            raise ValueError(f"bad window price multiplier {item!r}: use window=multiplier, e.g. 1h=2.0")
        parse_duration(name)
        if name in multipliers:
            raise ValueError(f"window {name!r} has two price multipliers")
        try:
            multiplier = Decimal(value)
        except InvalidOperation:
            raise ValueError(f"bad price multiplier {value!r} for window {name!r}: not a decimal") from None
        if not multiplier.is_finite() or multiplier <= 0:
            raise ValueError(f"bad price multiplier {value!r} for window {name!r}: must be positive")
        multipliers[name] = multiplier
    return multipliers
