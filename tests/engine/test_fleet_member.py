"""A supervisor as a member of a fleet (_core/fleet.py's ``Member``), on a fleet's store
faked in memory: what it asks the store, and what it does with the answers (docs/design.md,
"The fleet": F2, F3, F5, F6, F8; O3, O9, O11, H1, Z1). PostgresStore's side of the same
rules is tested in tests/rules/test_fleet.py and tests/adapters/test_postgres_store.py;
these run in a moment, under Trio's MockClock, so that mutation testing covers Member."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

import pytest
import trio
import trio.testing

from trio_supervisor import (
    Disposed,
    Handle,
    Key,
    Limits,
    Load,
    MemoryStore,
    OpenRecord,
    Phase,
    QuotaClaim,
    QuotaExceededError,
    RunnerClosingError,
    SessionRecord,
    SessionStoppedError,
    Shutdown,
    StaleSessionError,
    StateStorageError,
    StoppedRecord,
    Superseded,
    Termination,
    TerminationUnconfirmedError,
    open_supervisor,
)
from trio_supervisor.abc import FleetMember, FleetStore
from trio_supervisor.model import ExitStatus, FleetRecord, RunnerInfo
from trio_supervisor.testing import FakeExecution

KEY = Key(identity="fleet", instance="one")
OTHER = Key(identity="fleet", instance="two")


class FleetOfOne(MemoryStore):
    """A fleet's store in memory, of which this supervisor is the only live member: what
    "other runners" did is set by the test (their marks, their records)."""

    def __init__(self) -> None:
        super().__init__()
        self.marks: dict[Key, int] = {}  # high-waters set by other runners
        self.answered: dict[tuple[Key, str], SessionRecord] = {}  # their opens, by request
        self.elsewhere: dict[str, FleetRecord] = {}  # their records, by token
        self.lookups: list[tuple[Key, str | None]] = []
        self.lookup_fails: Exception | None = None
        self.held_fails: Exception | None = None
        self.over_quota: QuotaExceededError | None = None  # save_within refuses with it
        self.claims: list[tuple[str, QuotaClaim]] = []
        self.waited: list[Handle] = []  # the handles wait_older_stopped was asked about
        self.older: trio.Event | None = None  # set: wait_older_stopped waits for it
        self.older_fails: BaseException | None = None
        self.waiting = trio.Event()  # a wait_older_stopped began
        self.save_hold: trio.Event | None = None
        self.saving = trio.Event()  # a save began
        self.joined: FleetMember | None = None
        self.leave: trio.Event = trio.Event()  # set: run_member fails
        self.member_left: Exception = StateStorageError("another runner took this row")

    @property
    def member(self) -> str:
        return "here"

    async def save(self, record: SessionRecord) -> None:
        self.saving.set()
        if self.save_hold is not None:
            await self.save_hold.wait()
        if isinstance(record, OpenRecord):
            # Global fencing, as the protocol has it: the fleet's mark + 1, or nothing.
            key = record.handle.key
            mark = max((await self.high_water()).get(key, 0), self.marks.get(key, 0))
            if record.handle.generation != mark + 1:
                raise StaleSessionError(f"the fleet's high-water of this key is {mark}")
        await super().save(record)

    async def save_within(self, record: SessionRecord, quota: QuotaClaim) -> None:
        self.claims.append((record.phase.value, quota))
        if self.over_quota is not None:
            await trio.lowlevel.checkpoint()
            raise self.over_quota
        await self.save(record)

    async def lookup(self, key: Key, request_id: str | None) -> tuple[int, SessionRecord | None]:
        await trio.lowlevel.checkpoint()
        self.lookups.append((key, request_id))
        if self.lookup_fails is not None:
            raise self.lookup_fails
        own = (await self.high_water()).get(key, 0)
        prior = None if request_id is None else self.answered.get((key, request_id))
        return max(own, self.marks.get(key, 0)), prior

    async def wait_older_stopped(self, handle: Handle) -> None:
        self.waited.append(handle)
        self.waiting.set()
        if self.older is not None:
            await self.older.wait()
        else:
            await trio.lowlevel.checkpoint()
        if self.older_fails is not None:
            raise self.older_fails

    async def run_member(self, member: FleetMember) -> None:
        self.joined = member
        await self.leave.wait()
        raise self.member_left

    async def runners(self) -> Sequence[RunnerInfo]:
        raise NotImplementedError

    async def fleet_records(self) -> Sequence[FleetRecord]:
        raise NotImplementedError

    async def held(self, token: str) -> FleetRecord | None:
        await trio.lowlevel.checkpoint()
        if self.held_fails is not None:
            raise self.held_fails
        return self.elsewhere.get(token)

    async def owner(self, token: str) -> RunnerInfo | None:
        raise NotImplementedError

    async def drain(self) -> None:
        raise NotImplementedError


def test_the_fake_is_a_fleet_store() -> None:
    assert isinstance(FleetOfOne(), FleetStore)


def _stopped_elsewhere(handle: Handle) -> StoppedRecord:
    opened = OpenRecord(handle=handle, request_id="there", lease=10.0, limits=Limits())
    return StoppedRecord.of(opened, Superseded(), Termination(kind="none", exit=ExitStatus()))


async def test_f3_high_water_and_open_read_the_fleets_marks(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store = FleetOfOne()
    store.marks[KEY] = 3  # another runner opened generation 3
    async with open_supervisor(store, FakeExecution(), lease=10.0) as sup:
        assert await sup.high_water(KEY) == 3
        assert await sup.high_water(OTHER) is None
        store.lookups.clear()
        # The host expects what this runner's index knows (a key never opened): its
        # Open record goes first, loses, and the lookup then says why, and whether
        # this is a retry (O3).
        with pytest.raises(StaleSessionError, match="high-water generation is 3"):
            await sup.open(KEY, "r1")
        assert store.lookups == [(KEY, "r1")]
        # The runner knows the mark now: an open that expects it needs no lookup.
        record = await sup.open(KEY, "r2", expected_generation=3)
        assert record.handle.generation == 4
        assert store.lookups == [(KEY, "r1")]
        # One that expects another generation than the runner knows looks first.
        with pytest.raises(StaleSessionError, match="high-water generation is 4"):
            await sup.open(KEY, "r3", expected_generation=2)
        assert store.lookups[-1] == (KEY, "r3")  # the request id, for a retry (O3)
        assert await sup.high_water(KEY) == 4


async def test_f3_o3_a_request_another_runner_answered_returns_its_record(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store = FleetOfOne()
    theirs = OpenRecord(
        handle=Handle(key=KEY, token="t-1", generation=5),
        request_id="r1",
        lease=10.0,
        limits=Limits(),
    )
    store.answered[KEY, "r1"] = theirs
    store.marks[KEY] = 7  # opened again since, elsewhere
    async with open_supervisor(store, FakeExecution(), lease=10.0) as sup:
        assert await sup.open(KEY, "r1") is theirs
        assert list(await store.list()) == []  # nothing saved here
        # Answering the retry took no mark into the index: a new request checks afresh.
        store.marks[KEY] = 0
        record = await sup.open(KEY, "r2")
        assert record.handle.generation == 1


async def test_f3_a_store_that_cannot_be_read_fails_the_open_by_name(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store = FleetOfOne()
    store.lookup_fails = OSError("connection reset")
    store.marks[KEY] = 2  # another runner opened it: the Open record loses, and reads
    async with open_supervisor(store, FakeExecution(), lease=10.0) as sup:
        with pytest.raises(StateStorageError) as refused:
            await sup.open(KEY, "r1")
        assert str(refused.value) == (
            "the fleet's store could not be read: OSError('connection reset')"
        )
        with pytest.raises(StateStorageError, match="could not be read"):
            await sup.high_water(KEY)
        store.lookup_fails = StateStorageError("the row is gone")
        with pytest.raises(StateStorageError) as kept:
            await sup.open(KEY, "r1")
        assert str(kept.value) == "the row is gone"  # a StateStorageError as it is


async def test_f6_o9_an_open_returns_once_the_older_generation_stopped_and_its_lease_starts_then(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store = FleetOfOne()
    store.older = trio.Event()
    async with open_supervisor(store, FakeExecution(), lease=5.0) as sup, trio.open_nursery() as n:
        opened: list[SessionRecord] = []

        async def open_it() -> None:
            opened.append(await sup.open(KEY, "r1"))

        n.start_soon(open_it)
        await store.waiting.wait()
        await trio.sleep(20.0)  # longer than the lease
        assert opened == []
        store.older.set()
        await trio.testing.wait_all_tasks_blocked()
        [record] = opened
        assert store.waited == [record.handle]  # the wait is for this generation's elders
        assert not sup._fleet._waits  # type: ignore[attr-defined]  # a wait over is forgotten
        returned = trio.current_time()
        await trio.sleep(4.9)
        assert isinstance(await sup.status(record.handle), OpenRecord)  # O9
        await trio.sleep(0.2)
        await trio.testing.wait_all_tasks_blocked()
        assert trio.current_time() - returned == pytest.approx(5.1)
        assert isinstance(await sup.status(record.handle), StoppedRecord)


async def test_f6_an_older_generation_that_never_stops_fails_the_open_and_disposes_its_session(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    store = FleetOfOne()
    store.older_fails = TerminationUnconfirmedError("runner b did not stop generation 1")
    async with open_supervisor(store, FakeExecution(), lease=10.0) as sup:
        with caplog.at_level(logging.WARNING, logger="trio_supervisor.supervisor"):
            with pytest.raises(TerminationUnconfirmedError, match="did not stop generation 1"):
                await sup.open(KEY, "r1")
            await trio.testing.wait_all_tasks_blocked()
        [record] = sup.records()  # O11: the session existed, and was stopped
        assert isinstance(record, StoppedRecord)
        assert record.reason == Disposed()
        assert "generation 1 of fleet/one is stopped: its open failed" in caplog.text


async def test_f6_any_other_failure_of_the_wait_fails_the_open_and_leaves_the_session(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store = FleetOfOne()
    store.older_fails = StateStorageError("the fleet's store went away")
    async with open_supervisor(store, FakeExecution(), lease=10.0) as sup:
        with pytest.raises(StateStorageError, match="went away"):
            await sup.open(KEY, "r1")
        [record] = sup.records()  # O11: it exists; its lease ends it
        assert isinstance(record, OpenRecord)


async def test_o11_an_open_cancelled_while_it_waits_raises_the_cancellation_and_the_session_exists(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store = FleetOfOne()
    store.older = trio.Event()
    async with open_supervisor(store, FakeExecution(), lease=10.0) as sup:
        with trio.move_on_after(3.0) as scope:
            await sup.open(KEY, "r1")
        assert scope.cancelled_caught
        [record] = sup.records()
        assert isinstance(record, OpenRecord)
        assert not sup.closing
        store.older.set()


async def test_z1_a_shutdown_ends_an_open_waiting_for_an_older_generation(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store = FleetOfOne()
    store.older = trio.Event()  # never set: only the shutdown ends the wait
    failures: list[BaseException] = []
    records: list[SessionRecord] = []
    async with trio.open_nursery() as nursery:
        async with open_supervisor(store, FakeExecution(), lease=10.0) as sup:

            async def open_it() -> None:
                try:
                    await sup.open(KEY, "r1")
                except RunnerClosingError as error:
                    failures.append(error)

            nursery.start_soon(open_it)
            await store.waiting.wait()
        records.extend(sup.records())
    [failure] = failures
    assert str(failure) == "the supervisor is shutting down"
    [record] = records
    assert isinstance(record, StoppedRecord)
    assert record.reason == Shutdown()  # Z2: it exists, and stops with the others


async def test_z1_an_open_whose_save_outlasted_the_shutdowns_start_does_not_wait(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store = FleetOfOne()
    store.older = trio.Event()  # never set
    failures: list[BaseException] = []
    async with (
        trio.open_nursery() as nursery,
        open_supervisor(store, FakeExecution(), lease=10.0) as sup,
    ):

        async def open_it() -> None:
            try:
                await sup.open(KEY, "r1")
            except RunnerClosingError as error:
                failures.append(error)

        store.save_hold = trio.Event()
        nursery.start_soon(open_it)
        await store.saving.wait()

        async def release() -> None:
            await trio.testing.wait_all_tasks_blocked()
            assert sup.closing
            assert store.save_hold is not None
            store.save_hold.set()

        nursery.start_soon(release)
    assert [str(failure) for failure in failures] == ["the supervisor is shutting down"]


async def test_f5_a_renew_asks_nothing_and_a_supersede_the_store_tells_of_stops_it(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store = FleetOfOne()
    async with open_supervisor(store, FakeExecution(), lease=10.0) as sup:
        record = await sup.open(KEY, "r1")
        looked = len(store.lookups)
        store.marks[KEY] = 2  # opened again elsewhere; the store has not told yet
        assert await sup.renew(record.handle) == 10.0
        assert len(store.lookups) == looked  # a renew reads nothing (deviation (n))
        member = store.joined
        assert member is not None
        assert member.shortest_lease() == 10.0  # its check comes round that often / 3
        member.superseded(KEY, 2)  # the notification, or the store's periodic check
        with pytest.raises(SessionStoppedError, match="Superseded"):
            await sup.renew(record.handle)
        await trio.testing.wait_all_tasks_blocked()
        stopped = await sup.status(record.handle)
        assert isinstance(stopped, StoppedRecord)
        assert stopped.reason == Superseded()
        assert member.shortest_lease() is None  # no session left to check for


async def test_f8_a_session_stopped_elsewhere_is_answered_here(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store = FleetOfOne()
    handle = Handle(key=KEY, token="t-elsewhere", generation=2)
    stopped = _stopped_elsewhere(handle)
    store.elsewhere[handle.token] = FleetRecord(record=stopped, runner_id="b", epoch=1)
    async with open_supervisor(store, FakeExecution(), lease=10.0) as sup:
        assert await sup.status(handle) == stopped
        assert await sup.dispose(handle) == stopped.termination
        with pytest.raises(SessionStoppedError):
            await sup.renew(handle)
        # Another generation under the same token is no record of this one's.
        wrong = Handle(key=KEY, token="t-elsewhere", generation=3)
        with pytest.raises(StaleSessionError):
            await sup.status(wrong)
        with pytest.raises(StaleSessionError):
            await sup.renew(wrong)


async def test_f8_a_session_live_elsewhere_is_unknown_here(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store = FleetOfOne()
    handle = Handle(key=KEY, token="t-live", generation=1)
    live = OpenRecord(handle=handle, request_id="there", lease=10.0, limits=Limits())
    store.elsewhere[handle.token] = FleetRecord(record=live, runner_id="b", epoch=1)
    async with open_supervisor(store, FakeExecution(), lease=10.0) as sup:
        with pytest.raises(StaleSessionError):
            await sup.status(handle)
        with pytest.raises(StaleSessionError):
            await sup.dispose(handle)
        with pytest.raises(StaleSessionError):
            await sup.status(Handle(key=KEY, token="t-nowhere", generation=1))
        store.held_fails = OSError("connection reset")
        with pytest.raises(StateStorageError) as unreadable:
            await sup.status(handle)
        assert str(unreadable.value) == (
            "the fleet's store could not be read: OSError('connection reset')"
        )


async def test_f2_the_member_tells_the_store_its_stop_bound_live_keys_and_times(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    store = FleetOfOne()
    async with open_supervisor(
        store, FakeExecution(), lease=10.0, grace=3.0, confirmation_timeout=2.0
    ) as sup:
        member = store.joined
        assert member is not None
        assert member.stop_bound == 5.0  # grace + confirmation (+ no switch slack)
        first = await sup.open(KEY, "r1")
        await trio.sleep(4.0)
        other = await sup.open(OTHER, "r2")
        live: Mapping[Key, int] = member.live()
        assert dict(live) == {KEY: 1, OTHER: 1}
        times = member.times()
        assert times[first.handle.token] == pytest.approx((4.0, 6.0))
        assert times[other.handle.token] == pytest.approx((0.0, 10.0))
        # F5: told of a later generation of KEY, it stops the older one.
        with caplog.at_level(logging.INFO, logger="trio_supervisor.supervisor"):
            member.superseded(KEY, 2)
            await trio.testing.wait_all_tasks_blocked()
        [told] = [entry for entry in caplog.records if "superseded by" in entry.message]
        assert told.levelname == "INFO"
        assert told.message == (
            "generation 1 of fleet/one is superseded by generation 2, opened on another "
            "runner of the fleet"
        )
        fields = vars(told)  # a log record has its extra= fields as attributes
        assert (fields["identity"], fields["instance"], fields["generation"]) == ("fleet", "one", 1)
        stopped = await sup.status(first.handle)
        assert isinstance(stopped, StoppedRecord)
        assert stopped.reason == Superseded()
        assert dict(member.live()) == {OTHER: 1}
        # The index took the mark, though the store (faked) did not hear of it.
        with pytest.raises(StaleSessionError, match="high-water generation is 2"):
            await sup.open(KEY, "r3", expected_generation=1)
        member.superseded(OTHER, 1)  # not below: nothing stops
        await trio.testing.wait_all_tasks_blocked()
        assert isinstance(await sup.status(other.handle), OpenRecord)


async def test_h1_a_member_that_leaves_the_fleet_is_poisoned(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    store = FleetOfOne()
    seen: dict[str, object] = {}

    async def run() -> None:
        async with open_supervisor(store, FakeExecution(), lease=10.0) as sup:
            seen["before"] = sup.poisoned
            with caplog.at_level(logging.ERROR, logger="trio_supervisor.supervisor"):
                store.leave.set()
                await trio.testing.wait_all_tasks_blocked()
            seen["after"] = sup.poisoned
            with pytest.raises(StateStorageError):
                await sup.open(KEY, "r1")

    with pytest.raises(BaseExceptionGroup) as left:  # Z3: the poisoning is reported
        await run()
    assert left.group_contains(StateStorageError)
    assert seen == {"before": None, "after": store.member_left}
    [left_fleet] = [entry for entry in caplog.records if "left the fleet" in entry.message]
    assert left_fleet.message == "this runner left the fleet: another runner took this row"


async def test_f1_a_member_stays_in_the_fleet_until_its_sessions_stopped(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store = FleetOfOne()
    async with open_supervisor(store, FakeExecution(), lease=10.0) as sup:
        await sup.open(KEY, "r1")
    # The member task was cancelled at the end, not failed: nothing poisoned it.
    assert sup.poisoned is None
    assert store.joined is not None


async def test_f9_a_load_refused_over_its_quota_leaves_the_session_open_to_load_again(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    store = FleetOfOne()
    claim = QuotaClaim(tenant="acme", identities=("fleet",), children=0)
    refusal = QuotaExceededError(
        "tenant 'acme' exceeded quota: children, requested 1, used 0, limited 0",
        quota="children",
        requested=1,
        hard=0,
    )
    async with open_supervisor(store, FakeExecution(), lease=10.0) as sup:
        record = await sup.open(KEY, "r1", quota=claim)
        store.over_quota = refusal
        with (
            caplog.at_level(logging.INFO, logger="trio_supervisor.session"),
            pytest.raises(QuotaExceededError) as refused,
        ):
            await sup.load(record.handle, Load(specifier="plugin:main"), quota=claim)
        assert str(refused.value) == str(refusal)
        assert (refused.value.quota, refused.value.requested) == ("children", 1)
        assert store.claims == [("Open", claim), ("Loading", claim)]
        assert sup.poisoned is None  # an answer, not a failure
        # Nothing of the load is durable: the session is Open, live, and may load later.
        assert await sup.status(record.handle) == record
        assert sup.live_records() == [record]
        [told] = [entry for entry in caplog.records if "was refused" in entry.message]
        assert told.message == (
            "loading into trio_supervisor session fleet/one #1 was refused: "
            "tenant 'acme' exceeded quota: children, requested 1, used 0, limited 0"
        )
        fields = vars(told)  # a log record has its extra= fields as attributes
        assert (fields["identity"], fields["instance"], fields["generation"]) == ("fleet", "one", 1)
        store.over_quota = None
        await sup.load(record.handle, Load(specifier="plugin:other"), quota=claim)
        loaded = await sup.status(record.handle)
        assert loaded.phase is Phase.LOADED
        await sup.renew(record.handle)
        # A session refused its load has no task again: a stop runs in the caller's.
        other = await sup.open(OTHER, "r2")
        store.over_quota = refusal
        with pytest.raises(QuotaExceededError):
            await sup.load(other.handle, Load(specifier="plugin:main"), quota=claim)
        termination = await sup.dispose(other.handle)
        assert termination.describe() == "no child"
        stopped = await sup.status(other.handle)
        assert isinstance(stopped, StoppedRecord)
        assert stopped.reason == Disposed()
