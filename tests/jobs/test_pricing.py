"""Integer cost arithmetic: exact fractions, one rounding per component, halves up."""

from __future__ import annotations

import random
from decimal import Decimal
from fractions import Fraction

import pytest

from backfill.jobs.billing.ledger import (
    Rates,
    component_cost,
    format_micros,
    parse_money,
    price_request,
    scale_micros,
    window_multiplier,
    window_rates,
)
from backfill.jobs.billing.models import Price
from backfill.jobs.errors import InvalidRequest


def _reference(tokens: int, rate: int, discount: int) -> int:
    exact = Fraction(tokens * rate, 1_000_000) * Fraction(100 - discount, 100)
    whole, rest = divmod(exact, 1)
    return int(whole) + (1 if rest >= Fraction(1, 2) else 0)


def test_rounding_is_to_the_nearest_micro_with_halves_up() -> None:
    # $1 per million tokens at 50% off: half a micro per token.
    assert component_cost(1, 1_000_000, 50) == 1  # 0.5 -> 1
    assert component_cost(2, 1_000_000, 50) == 1  # 1.0
    assert component_cost(3, 1_000_000, 50) == 2  # 1.5 -> 2
    assert component_cost(1, 1_000_000, 70) == 0  # 0.3 -> 0
    assert component_cost(1, 1_000_000, 30) == 1  # 0.7 -> 1
    assert component_cost(0, 9_999_999, 0) == 0
    assert component_cost(1_000_000, 2_500_000, 0) == 2_500_000  # a million tokens cost the list price
    assert component_cost(1_000_000, 2_500_000, 100) == 0


def test_matches_exact_fractions_on_random_inputs() -> None:
    rng = random.Random(7)
    for _ in range(5000):
        tokens = rng.randrange(0, 2_000_000)
        rate = rng.randrange(0, 100_000_000)
        discount = rng.randrange(0, 101)
        assert component_cost(tokens, rate, discount) == _reference(tokens, rate, discount)


def test_no_float_drift_on_huge_volumes() -> None:
    # 10^15 tokens at $0.15/M with 50% off: exactly 75,000,000 currency units.
    assert component_cost(10**15, 150_000, 50) == 75_000_000 * 1_000_000


def test_request_cost_splits_cached_and_uncached_input() -> None:
    rates = Rates(input=150_000, cached_input=75_000, output=600_000, discount_percent=50)
    cost = price_request(rates, prompt_tokens=4077, cached_tokens=4032, completion_tokens=4)
    assert cost.input_micros == component_cost(45, 150_000, 50) == 3  # 3.375
    assert cost.cached_input_micros == component_cost(4032, 75_000, 50) == 151  # 151.2
    assert cost.output_micros == component_cost(4, 600_000, 50) == 1  # 1.2
    assert cost.total_micros == 155
    # The same tokens all uncached cost more: cached tokens are billed at the cached rate.
    assert price_request(rates, prompt_tokens=4077, cached_tokens=0, completion_tokens=4).total_micros == 307


def test_reasoning_is_output_once_and_cached_is_capped_by_prompt() -> None:
    rates = Rates(input=1_000_000, cached_input=500_000, output=4_000_000, discount_percent=0)
    cost = price_request(rates, prompt_tokens=10, cached_tokens=50, completion_tokens=7)
    assert (cost.input_micros, cost.cached_input_micros, cost.output_micros) == (0, 5, 28)


@pytest.mark.parametrize(
    ("text", "micros"),
    [("2.50", 2_500_000), ("0.075", 75_000), ("0", 0), ("1e-6", 1), (2.5, 2_500_000), (3, 3_000_000)],
)
def test_parse_money(text: object, micros: int) -> None:
    assert parse_money(text, param="input") == micros


@pytest.mark.parametrize("text", ["0.0000001", "-1", "abc", "nan", "inf", ""])
def test_parse_money_refuses(text: str) -> None:
    with pytest.raises(InvalidRequest):
        parse_money(text, param="input")


def test_format_micros_is_exact() -> None:
    assert format_micros(0) == "0.000000"
    assert format_micros(155) == "0.000155"
    assert format_micros(2_500_000) == "2.500000"
    assert format_micros(123_456_789_012) == "123456.789012"
    assert parse_money(format_micros(987_654_321), param="x") == 987_654_321


# -- completion windows: a window's own price, or the general one times its multiplier --------

MULTIPLIERS = {"1h": Decimal("2.0"), "4h": Decimal("1.5"), "7d": Decimal("0.6")}


def _row(window: str | None = None) -> Price:
    return Price(
        model="m",
        completion_window=window,
        input_micros_per_million=150_000,
        cached_input_micros_per_million=75_001,
        output_micros_per_million=600_000,
        batch_discount_percent=50,
    )


def test_scaling_rounds_to_the_micro_with_halves_up() -> None:
    assert scale_micros(75_001, Decimal("1.5")) == 112_502  # 112501.5 -> 112502
    assert scale_micros(75_001, Decimal("0.6")) == 45_001  # 45000.6 -> 45001
    assert scale_micros(3, Decimal("0.5")) == 2  # 1.5 -> 2
    assert scale_micros(1, Decimal("0.4")) == 0
    assert scale_micros(0, Decimal(2)) == 0


def test_the_general_price_is_scaled_per_window() -> None:
    general = _row()
    assert window_rates(general, "1h", MULTIPLIERS) == Rates(300_000, 150_002, 1_200_000, 50)
    assert window_rates(general, "7d", MULTIPLIERS) == Rates(90_000, 45_001, 360_000, 50)
    # A window with no multiplier pays the general price as it stands.
    assert window_rates(general, "24h", MULTIPLIERS) == Rates(150_000, 75_001, 600_000, 50)
    assert window_multiplier(general, "4h", MULTIPLIERS) == Decimal("1.5")


def test_a_windows_own_price_is_never_scaled() -> None:
    own = _row("1h")
    assert window_rates(own, "1h", MULTIPLIERS) == Rates(150_000, 75_001, 600_000, 50)
    assert window_multiplier(own, "1h", MULTIPLIERS) == 1
