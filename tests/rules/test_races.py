"""Dispose, lease expiry, child exit, supersede and shutdown racing on one session.

In every order, the child is terminated exactly once, the first request fixes the
reason, and every caller sees the one outcome.

Two kinds of race. The permutations fire the five requests one virtual millisecond
apart, in every order, so the winner is known in advance. The seeded races let a seed
choose what the permutations cannot: which requests fire at the very same virtual
instant (ties), the order in which their tasks were started, and the order in which
Trio runs the tasks that wake together. Each seed gives one reproducible interleaving.
"""

from __future__ import annotations

import contextlib
import itertools
import random
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence

import attrs
import pytest
import trio
import trio.testing

from trio_supervisor import (
    Exited,
    ExitStatus,
    Load,
    MemoryStore,
    Retention,
    RunnerClosingError,
    StoppedRecord,
    SupervisorError,
    Termination,
)
from trio_supervisor.testing import FakeExecution

from ..support.sessions import KEY, supervise

TRIGGERS = ("dispose", "expiry", "exit", "supersede", "shutdown")
REASONS = {
    "dispose": "Disposed",
    "expiry": "Expired",
    "exit": "Exited",
    "supersede": "Superseded",
    "shutdown": "Shutdown",
}
EXIT_DELAY = 0.01  # how long the child takes to exit once interrupted
STEP = 0.001  # between triggers in the permutations, so all land during the stop
# What a seed draws each trigger's time from, in seconds after 1.0: equal draws are
# ties; up to 0.005 a later trigger lands while the stop runs (the child takes
# EXIT_DELAY to exit); at 0.02 it comes after the stop is over (a dispose then answers
# from the record, a supersede opens the next generation).
OFFSETS = (0.0, 0.001, 0.002, 0.005, 0.02)
SEEDS = range(20)


@attrs.frozen
class Race:
    """What one race left behind."""

    record: StoppedRecord  # the raced session's Stopped record
    fake: FakeExecution
    outcomes: list[object]  # what dispose returned or raised
    fired: tuple[str, ...]  # the triggers in the order their tasks acted (not expiry)

    @property
    def trace(self) -> tuple[tuple[str, ...], str]:
        """The interleaving as observed: the order the triggers acted in, and who won."""
        return self.fired, self.record.reason.kind


async def _at(when: float, action: Callable[[], Awaitable[None]]) -> None:
    await trio.sleep_until(when)
    await action()


async def race(times: Mapping[str, float], start_order: Sequence[str] = TRIGGERS) -> Race:
    """Load a child, then fire every trigger at its time (seconds after the load).

    The dispose, supersede and exit tasks are started in ``start_order``; the shutdown is
    the block ending, and the expiry is the lease running out.
    """
    fake = FakeExecution()
    fake.behave("x", exit_delay=EXIT_DELAY)
    store = MemoryStore(retention=Retention(stopped_per_key=5))
    outcomes: list[object] = []
    fired: list[str] = []
    async with trio.open_nursery() as callers, supervise(store, fake, grace=1.0) as sup:
        start = trio.current_time()
        handle = (await sup.open(KEY, "r1", lease=times["expiry"])).handle
        await sup.load(handle, Load(specifier="x"))
        # The fakes take no virtual time: the lease counts from ``start``, as the
        # triggers do, so a trigger at the expiry time ties with the timer exactly.
        assert trio.current_time() == start

        async def dispose() -> None:
            fired.append("dispose")
            try:
                outcomes.append(await sup.dispose(handle))
            except SupervisorError as error:
                outcomes.append(error)

        async def supersede() -> None:
            fired.append("supersede")
            with contextlib.suppress(RunnerClosingError):
                await sup.open(KEY, "r2", expected_generation=1)

        async def exit_() -> None:
            fired.append("exit")
            fake.unit_of(handle).exit(code=7)

        actions = {"dispose": dispose, "supersede": supersede, "exit": exit_}
        for name in start_order:
            if name in actions:
                callers.start_soon(_at, start + times[name], actions[name])
        await trio.sleep_until(start + times["shutdown"])
        fired.append("shutdown")
    [first] = [stored for stored in await store.list() if stored.handle == handle]
    assert isinstance(first, StoppedRecord)
    return Race(record=first, fake=fake, outcomes=outcomes, fired=tuple(fired))


def check_exactly_once(result: Race) -> None:
    record, fake = result.record, result.fake
    [unit] = fake.units
    signals = unit.signals
    assert signals.count("interrupt") <= 1
    assert signals.count("kill") == 0
    assert unit.closed == 1
    assert [call.name for call in fake.calls_of(unit)].count("aclose") == 1
    assert result.outcomes == [record.termination], "the one dispose got the one outcome"
    if record.reason == Exited():
        assert signals == [], "X1: a child that exited by itself gets no signal"
        assert record.termination == Termination(kind="exited", exit=ExitStatus(code=7))
    else:
        assert signals == ["interrupt"]


@contextlib.contextmanager
def seeded_scheduler(seed: int) -> Iterator[None]:
    """Make the order in which Trio runs tasks that wake together a function of ``seed``.

    Trio shuffles each batch of runnable tasks with one module-level ``random.Random``,
    after sorting it by task creation when deterministic scheduling is allowed (the
    switch pytest-trio and Hypothesis turn on to replay examples). Both are private to
    Trio, hence this one helper; the previous state is put back afterwards.
    """
    run = trio._core._run
    scheduler: random.Random = run._r
    state, allowed = scheduler.getstate(), run._ALLOW_DETERMINISTIC_SCHEDULING
    setattr(run, "_ALLOW_DETERMINISTIC_SCHEDULING", True)  # noqa: B010 (a Final name)
    scheduler.seed(seed)
    try:
        yield
    finally:
        scheduler.setstate(state)
        setattr(run, "_ALLOW_DETERMINISTIC_SCHEDULING", allowed)  # noqa: B010


async def seeded_race(seed: int, *, all_at_once: bool = False) -> tuple[Race, dict[str, float]]:
    """One race whose times, task start order and tie-breaks all come from ``seed``."""
    rng = random.Random(seed)
    start_order = rng.sample(TRIGGERS, k=len(TRIGGERS))
    times = {trigger: 1.0 + (0.0 if all_at_once else rng.choice(OFFSETS)) for trigger in TRIGGERS}
    with seeded_scheduler(seed):
        return await race(times, start_order), times


@pytest.mark.parametrize("order", list(itertools.permutations(TRIGGERS)), ids="-".join)
async def test_every_order_terminates_the_child_once_and_the_first_request_wins(
    order: tuple[str, ...], autojump_clock: trio.testing.MockClock
) -> None:
    times = {trigger: 1.0 + STEP * index for index, trigger in enumerate(order)}
    result = await race(times, start_order=order)
    assert result.record.reason.kind == REASONS[order[0]]
    check_exactly_once(result)
    # The expiry is the supervisor's lease timer, not one of these tasks; every other
    # trigger acted, in the order of its time.
    assert result.fired == tuple(trigger for trigger in order if trigger != "expiry")


@pytest.mark.parametrize("seed", SEEDS)
async def test_seeded_ties_and_offsets_terminate_the_child_once_and_an_earliest_request_wins(
    seed: int, autojump_clock: trio.testing.MockClock
) -> None:
    result, times = await seeded_race(seed)
    check_exactly_once(result)
    # Whatever the scheduler does with a tie, a request made later cannot win (P1).
    earliest = min(times.values())
    assert result.record.reason.kind in {
        REASONS[trigger] for trigger, at in times.items() if at == earliest
    }


@pytest.mark.parametrize("seed", SEEDS)
async def test_all_at_once_terminates_the_child_once(
    seed: int, autojump_clock: trio.testing.MockClock
) -> None:
    result, _ = await seeded_race(seed, all_at_once=True)
    check_exactly_once(result)
    # All five at one instant: the four that ask directly (the lease timer among them)
    # get in before the exit (its watcher must first wake), whichever way the tie is
    # broken.
    assert result.record.reason.kind in {"Disposed", "Superseded", "Shutdown", "Expired"}


async def test_the_seeds_reach_different_orders_and_each_seed_replays_its_own(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # Evidence that the parametrized seeds above are not twenty copies of one run. Over
    # SEEDS (Trio 0.35), all at once: Superseded wins 7 times, Disposed 7, Expired 4,
    # Shutdown 2, in 16 different traces. With seeded offsets: Shutdown 7, Expired 5,
    # Superseded 4, Disposed 3, Exited 1, in 16 different traces. (The seeds used to pick
    # an order that nothing read, so the seed changed nothing.)
    for all_at_once, distinct_winners in ((True, 3), (False, 4)):
        traces = {}
        for seed in SEEDS:
            result, _ = await seeded_race(seed, all_at_once=all_at_once)
            traces[seed] = result.trace
        assert len(set(traces.values())) > len(SEEDS) // 2
        assert len({winner for _, winner in traces.values()}) >= distinct_winners
        # A seed is a recipe: run again, it reproduces the same interleaving.
        for seed in (0, 7):
            again, _ = await seeded_race(seed, all_at_once=all_at_once)
            assert again.trace == traces[seed]
