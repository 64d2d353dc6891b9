"""`backfill up`'s stopping state machine (`backfill.up.Stopping`), without processes: the signal
that starts a stop interrupts the main thread once; signals that arrive while it stops are
counted from the start of the stop, however it started: the first says what it waits for,
the second SIGKILLs every component."""

from __future__ import annotations

import pytest

from backfill import up


class Kills:
    def __init__(self) -> None:
        self.count = 0

    def __call__(self) -> None:
        self.count += 1


@pytest.fixture
def said(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    lines: list[str] = []
    monkeypatch.setattr(up, "_say", lines.append)
    return lines


def _stopping() -> tuple[up.Stopping, Kills]:
    stopping, kills = up.Stopping(), Kills()
    stopping.kill_all = kills
    return stopping, kills


def test_a_stop_begun_by_a_component_exit_says_on_the_first_signal_and_kills_on_the_second(said: list[str]) -> None:
    stopping, kills = _stopping()
    stopping.begin()  # a component exited (or start-up failed): the stop began with no signal
    stopping(2)  # SIGINT: the user's first Ctrl-C
    assert kills.count == 0
    assert len(said) == 1 and "still stopping" in said[0]
    stopping(2)
    assert kills.count == 1


def test_a_stop_begun_by_a_signal_raises_once_says_then_kills(said: list[str]) -> None:
    stopping, kills = _stopping()
    with pytest.raises(KeyboardInterrupt):
        stopping(2)
    stopping(15)  # no second interrupt: the stop under way is never cut short
    assert (kills.count, len(said)) == (0, 1)
    stopping(2)
    assert kills.count == 1


def test_the_child_hook_loads_nothing_after_the_fork(monkeypatch: pytest.MonkeyPatch) -> None:
    """What runs between fork and exec is resolved before the fork: no import, no symbol lookup
    (another thread may hold the import lock, and the child has only the forking thread)."""
    calls: list[tuple[object, ...]] = []

    class Libc:
        looked_up = 0

        @property
        def prctl(self) -> object:
            Libc.looked_up += 1
            return lambda *a: calls.append(a)

    in_child = up._die_with_parent(Libc())  # type: ignore[arg-type]

    def no_import(*_: object, **__: object) -> None:
        raise AssertionError("imported in the child")

    monkeypatch.setattr("builtins.__import__", no_import)
    in_child()  # (unblocks SIGINT/SIGTERM here: they are not blocked in the test anyway)
    monkeypatch.undo()
    assert (Libc.looked_up, calls) == (1, [(1, int(up.signal.SIGTERM))])
