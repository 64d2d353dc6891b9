"""docs/configuration.md lists every setting the service reads, and only those."""

from __future__ import annotations

import re
from pathlib import Path

from backfill.storage.settings import Settings

DOC = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"
READ_FROM_THE_ENVIRONMENT = {"BACKFILL_FLEET_HOME", "BACKFILL_LOG_LEVEL"}  # not Settings fields


def test_every_setting_is_documented_and_every_documented_one_exists() -> None:
    documented = set(re.findall(r"BACKFILL_[A-Z0-9_]+[A-Z0-9]", DOC.read_text()))
    fields = {f"BACKFILL_{name.upper()}" for name in Settings.model_fields}
    assert fields - documented == set(), "settings missing from docs/configuration.md"
    assert documented - fields - READ_FROM_THE_ENVIRONMENT == set(), "documented settings the code does not read"
