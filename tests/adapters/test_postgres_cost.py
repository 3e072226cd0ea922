"""What a session costs the database (issue 43, item 2): the counts of ``python -m
benchmarks --only dbcost`` (``benchmarks/dbcost.py``), held to what docs/benchmarks.md's
cost table says. Exact where the count is deterministic; where it depends on timing (an
open's looks for the older generation it waits for) the bounds say so."""

from __future__ import annotations

import pytest
import trio

from benchmarks.dbcost import Cost, Upkeep, operations, upkeep

from ..support.postgres import own_schema

REPEATS = 3


@pytest.fixture(scope="module")
def costs(database: str) -> dict[str, Cost]:
    with own_schema(database) as schema:
        measured = trio.run(operations, database, schema, REPEATS)
    return {cost.operation: cost for cost in measured}


def test_a_renew_costs_the_database_nothing(costs: dict[str, Cost]) -> None:
    renew = costs["renew"]
    assert (renew.statement_count, renew.round_trips, renew.rows, renew.notify_count) == (
        0,
        0,
        0,
        0,
    )


def test_an_open_is_one_save(costs: dict[str, Cost]) -> None:
    opened = costs["open"]
    # The host expects what the runner knows (a new key): the Open record goes first,
    # its compare-and-set the check (F3), and the save says which older generations
    # other runners hold (none): no lookup, no look of its own.
    assert opened.statements == {"SAVE_BATCH": 1}
    # In autocommit: one round trip, one transaction.
    assert (opened.round_trips, opened.commits, opened.write_commits) == (1, 1, 1)
    # A new key: its high-water row made and raised, and its Open record.
    assert opened.rows == 3
    assert opened.notify_count == 0
    assert costs["high_water"].statements == {"LOOKUP": 1}
    assert costs["high_water"].round_trips == 1
    assert costs["high_water"].rows == 0


def test_a_load_and_a_dispose_are_one_write_per_record_batch(costs: dict[str, Cost]) -> None:
    load, loaded, childless = (
        costs["load"],
        costs["dispose, loaded"],
        costs["dispose, no child"],
    )
    # Loading before the spawn (L3), with the child's identity before it starts (L4),
    # Loaded: one round trip each.
    assert load.statements == {"SAVE_BATCH": 3}
    assert (load.round_trips, load.write_commits, load.rows) == (3, 3, 3)
    # With a child: Stopping before the signal, Stopped after (P2, P5).
    assert loaded.statements == {"SAVE_BATCH": 2}
    # Each Stopped record also counts itself in its runner's counter (retention's cap).
    assert (loaded.round_trips, loaded.write_commits, loaded.rows) == (2, 2, 3)
    # Without: both at once (deviation (k)).
    assert childless.statements == {"SAVE_BATCH": 1}
    assert (childless.round_trips, childless.write_commits, childless.rows) == (1, 1, 3)
    for cost in (load, loaded, childless):
        assert cost.notify_count == 0


def test_a_supersede_across_runners_notifies_twice_and_writes_six_rows(
    costs: dict[str, Cost],
) -> None:
    supersede = costs["supersede across runners"]
    # b: its lookup (the host expects a generation b never saw), its Open (which names
    # a's live generation), and a look once a's
    # stop was notified (or two, where the first came before a's save); a: Stopping
    # and Stopped, together.
    assert supersede.statements["LOOKUP"] == 1
    assert supersede.statements["SAVE_BATCH"] == 2
    assert 1 <= supersede.statements["OLDER"] <= 2
    assert set(supersede.statements) == {"LOOKUP", "SAVE_BATCH", "OLDER"}
    assert supersede.write_commits == 2
    assert supersede.notifies == {"stopped": 1, "superseded": 1}
    # The mark raised, b's Open record, the row in a's inbox, a's Stopping and Stopped
    # (a's read of its inbox, which deletes the row, is its upkeep's, and taken off).
    assert supersede.rows == 6  # and a's counter of Stopped records


def test_a_takeover_is_a_look_and_a_transaction_whatever_the_sessions(
    costs: dict[str, Cost],
) -> None:
    for sessions in (1, 100):
        cost = costs[f"takeover, {sessions} session{'s' * (sessions > 1)}"]
        assert cost.statements == {
            "DEAD": 1,
            "DEAD_ROW": 1,
            "DUE": 1,
            "NEXT_EPOCH": 1,
            "SAVE_BATCH": 1,
        }
        # DEAD alone; the rest in one transaction: BEGIN, four statements, COMMIT.
        assert (cost.round_trips, cost.commits, cost.write_commits) == (7, 2, 1)
        # Each session's record written Stopped, and the dead runner's epoch moved on.
        assert cost.rows == sessions + 2  # and the dead runner's counter of Stopped records


async def test_a_runner_s_upkeep_is_its_renewal_its_inbox_and_its_scan(database: str) -> None:
    with own_schema(database) as schema:
        # A runner lease of 1.5 s: a renewal and a scan every 0.5 s, and the read of
        # its inbox as often (a third of the runner lease, under a second).
        kept: Upkeep = await upkeep(database, schema, 3.0, live=50, runner_lease=1.5)
    assert set(kept.statements) <= {"RENEW", "INBOX", "DEAD"}
    # Each in autocommit: a round trip each.
    assert kept.round_trips == pytest.approx(sum(kept.statements.values()))
    per_period = {name: rate * 0.5 for name, rate in kept.statements.items()}
    for name in ("RENEW", "INBOX", "DEAD"):
        # About one each a period; a loaded machine makes some late.
        assert 0.4 <= per_period.get(name, 0) <= 1.2, kept
    # The inbox is one statement whatever the live keys, and empty here: only a
    # renewal writes, one short row.
    assert kept.write_commits == kept.statements["RENEW"]
    # (A renewal that straddles the window's edge may have its row on one side of it
    # and its commit on the other.)
    renewals = round(kept.statements["RENEW"] * kept.seconds)
    assert abs(round(kept.rows * kept.seconds) - renewals) <= 1
