"""Which line goes after which (`after`): an earlier turn of one session, which only that
session's later turns extend, not a prompt that is itself a shared prefix (a short eval question
ending where the preamble's blocks end, every other question going on from it)."""

from __future__ import annotations

from backfill.jobs.execution.prefixes import plan_prefix_order


def block(tag: str) -> bytes:
    return tag.encode().ljust(4, b"_")[:4]  # one block's fingerprint


def path(*tags: str) -> bytes:
    return b"".join(block(t) for t in tags)


def test_a_prompt_that_other_lines_branch_off_from_is_no_ones_previous_turn() -> None:
    preamble = ["p1", "p2", "p3"]
    paths = [
        path(*preamble, "qa", "qa2"),
        path(*preamble),  # a question short enough that its whole path is the preamble's
        path(*preamble, "qb"),
        path(*preamble, "qc", "qc2"),
    ]
    plan = plan_prefix_order(paths, [1, 2, 3, 4], kv=[100, 90, 95, 110])
    assert list(plan.after) == [0, 0, 0, 0]
    assert list(plan.session_kv) == [100, 90, 95, 110]  # no session: each line's own KV


def test_a_sessions_turns_still_go_one_after_another() -> None:
    system = ["s1", "s2"]
    turns = [path(*system, "u1"), path(*system, "u1", "a1", "u2"), path(*system, "u1", "a1", "u2", "a2", "u3")]
    other = path(*system, "v1")  # another session under the same system prompt: no line is that prompt
    plan = plan_prefix_order([turns[2], other, turns[0], turns[1]], [1, 2, 3, 4], kv=[300, 80, 100, 200])
    assert list(plan.after) == [4, 0, 0, 3]  # turn 3 after turn 2 after turn 1
    assert plan.session_kv[0] == plan.session_kv[2] == plan.session_kv[3] == 300


def test_turns_under_a_branching_prompt_go_after_their_own_session() -> None:
    # Line 1 is a prompt two sessions branch off from; each session's later turn follows its own first.
    paths = [path("x"), path("x", "a"), path("x", "a", "a2"), path("x", "b"), path("x", "b", "b2")]
    plan = plan_prefix_order(paths, [1, 2, 3, 4, 5])
    assert list(plan.after) == [0, 0, 2, 0, 4]
