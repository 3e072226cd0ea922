"""The jobs a store's thread serves (stores/_jobs.py), on a real thread of the test's:
group commit, withdrawn and abandoned jobs, answers to a run that ended, closing."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable

import pytest
import trio
import trio.testing

from trio_supervisor import (
    Disposed,
    ExitStatus,
    Handle,
    Key,
    Limits,
    MemoryStore,
    OpenRecord,
    Retention,
    StateStorageError,
    StoppedRecord,
    Termination,
)
from trio_supervisor.stores._jobs import Desk, Job, State, deliver, next_batch

BOUND = 10.0  # real seconds a test waits for its thread


class Thread:
    """A store's thread in miniature: it answers each job with its ``args`` and the size
    of the batch it came in; it holds a job whose args are "hold" until ``hold`` is set
    (the jobs queued meanwhile are its next batch). ``served`` lists the args of every
    job it answered, ``batches`` the size of each batch."""

    def __init__(self, *, closing_error: BaseException | None = None) -> None:
        self.holding = threading.Event()  # set once it holds a "hold" job
        self.hold = threading.Event()
        self.served: list[object] = []
        self.batches: list[int] = []
        self.closing_error = closing_error
        self.thread: threading.Thread | None = None

    def start(self, jobs: queue.SimpleQueue[Job]) -> Callable[[], None]:
        def run() -> None:
            self.thread = threading.current_thread()
            while True:
                taken, closing = next_batch(jobs)
                self.batches.append(len(taken))
                for job in taken:
                    if job.args == "hold":
                        self.holding.set()
                        self.hold.wait(BOUND)
                    if isinstance(job.args, BaseException):
                        job.error = job.args
                    else:
                        job.result = (job.args, len(taken))
                    self.served.append(job.args)
                deliver(taken)
                if closing is not None:
                    closing.error = self.closing_error
                    deliver([None, closing])
                    return

        return run


async def submit(desk: Desk, args: object) -> object:
    """Submit a job of ``args`` (made here: a job wakes the task that made it)."""
    return await desk.submit(Job("read", args=args))


async def until_holding(thread: Thread) -> None:
    assert await trio.to_thread.run_sync(thread.holding.wait, BOUND)


async def test_jobs_queued_while_the_thread_works_are_one_batch() -> None:
    thread = Thread()
    desk = Desk("a store's thread", "of the test", thread.start)
    assert await desk.submit(Job("read", args=1)) == (1, 1)
    answers: dict[object, object] = {}

    async def submit(args: object) -> None:
        answers[args] = await desk.submit(Job("read", args=args))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(submit, "hold")
        await until_holding(thread)
        for number in (2, 3, 4):
            nursery.start_soon(submit, number)
        await trio.testing.wait_all_tasks_blocked()
        thread.hold.set()
    assert answers == {"hold": ("hold", 1), 2: (2, 3), 3: (3, 3), 4: (4, 3)}
    assert thread.batches == [1, 1, 3]
    assert await desk.close() is None
    assert thread.thread is not None
    assert thread.thread.name == "a store's thread"
    assert thread.thread.daemon


async def test_a_job_cancelled_in_the_queue_is_never_served() -> None:
    thread = Thread()
    desk = Desk("a store's thread", "of the test", thread.start)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(submit, desk, "hold")
        await until_holding(thread)
        with trio.CancelScope() as scope:
            scope.cancel()  # cancelled as it waits in the queue
            await desk.submit(Job("write", args="withdrawn"))
        assert scope.cancelled_caught
        thread.hold.set()
    assert await desk.submit(Job("read", args="later")) == ("later", 1)
    assert thread.served == ["hold", "later"]
    # The withdrawn job was taken in a batch of its own, or with "later" if that came
    # first (a busy machine): served in neither.
    assert thread.batches in ([1, 0, 1], [1, 1])
    await desk.close()


async def test_a_job_cancelled_once_taken_is_answered_all_the_same() -> None:
    thread = Thread()
    desk = Desk("a store's thread", "of the test", thread.start)
    answer: list[object] = []

    async def submit(scope: trio.CancelScope) -> None:
        with scope:
            answer.append(await desk.submit(Job("write", args="hold")))
            await trio.lowlevel.checkpoint()  # where the cancellation is seen

    scope = trio.CancelScope()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(submit, scope)
        await until_holding(thread)
        scope.cancel()
        await trio.testing.wait_all_tasks_blocked()
        assert answer == []  # still waiting for the thread
        thread.hold.set()
    assert answer == [("hold", 1)]
    assert scope.cancelled_caught
    await desk.close()


async def test_an_abandoned_job_is_left_at_once_and_its_answer_dropped() -> None:
    thread = Thread()
    desk = Desk("a store's thread", "of the test", thread.start)
    with trio.CancelScope() as scope:
        job = Job("read", args="hold")

        async def cancel_once_held() -> None:
            await until_holding(thread)
            scope.cancel()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(cancel_once_held)
            await desk.submit(job, abandonable=True)
    assert scope.cancelled_caught
    assert job.state is State.WITHDRAWN
    thread.hold.set()  # its answer comes to nobody
    assert await desk.submit(Job("read", args="next")) == ("next", 1)
    assert thread.served == ["hold", "next"]
    await desk.close()


def test_an_answer_to_a_run_that_ended_is_dropped_and_the_thread_serves_on() -> None:
    thread = Thread()
    desk = Desk("a store's thread", "of the test", thread.start)

    async def leave() -> None:
        with trio.CancelScope() as scope:

            async def cancel_once_held() -> None:
                await until_holding(thread)
                scope.cancel()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(cancel_once_held)
                await desk.submit(Job("read", args="hold"), abandonable=True)
        assert scope.cancelled_caught

    trio.run(leave)
    thread.hold.set()  # the thread answers the run that ended

    async def again() -> object:
        with trio.fail_after(BOUND):
            answer = await desk.submit(Job("read", args="again"))
        await desk.close()
        return answer

    assert trio.run(again) == ("again", 1)
    assert thread.thread is not None
    thread.thread.join(BOUND)
    assert not thread.thread.is_alive()


async def test_a_job_s_error_is_raised_to_its_caller() -> None:
    thread = Thread()
    desk = Desk("a store's thread", "of the test", thread.start)
    failure = StateStorageError("the disk is full")
    with pytest.raises(StateStorageError) as raised:
        await desk.submit(Job("write", args=failure))
    assert raised.value is failure
    assert await desk.submit(Job("read", args=None)) == (None, 1)
    await desk.close()


async def test_closing_serves_the_jobs_queued_first_and_reports_its_own_failure() -> None:
    failure = StateStorageError("cannot close")
    thread = Thread(closing_error=failure)
    desk = Desk("a store's thread", "of the test", thread.start)
    answers: list[object] = []
    closed: list[BaseException | None] = []

    async def submit(args: object) -> None:
        answers.append(await desk.submit(Job("write", args=args)))

    async def close() -> None:
        closed.append(await desk.close())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(submit, "hold")
        await until_holding(thread)
        nursery.start_soon(submit, "queued")
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(close)
        await trio.testing.wait_all_tasks_blocked()
        thread.hold.set()
    assert sorted(answers) == [("hold", 1), ("queued", 1)]  # type: ignore[type-var]
    assert thread.served == ["hold", "queued"]
    assert thread.batches == [1, 1]
    assert closed == [failure]
    assert await desk.close() is None  # a second close does nothing
    with pytest.raises(StateStorageError) as refused:
        await desk.submit(Job("read"))
    assert refused.value.detail == "the store of the test is closed"


async def test_a_close_that_is_cancelled_still_waits_for_the_thread() -> None:
    thread = Thread()
    desk = Desk("a store's thread", "of the test", thread.start)
    await desk.submit(Job("read", args=0))
    with trio.CancelScope() as scope:
        scope.cancel()
        assert await desk.close() is None  # not cut short by the cancellation...
        await trio.lowlevel.checkpoint()  # ...which is seen here
    assert scope.cancelled_caught


async def test_a_desk_closed_before_use_starts_no_thread() -> None:
    started: list[object] = []

    def start(jobs: queue.SimpleQueue[Job]) -> Callable[[], None]:
        started.append(jobs)
        return lambda: None

    desk = Desk("a store's thread", "of the test", start)
    assert await desk.close() is None
    with pytest.raises(StateStorageError, match=r"^the store of the test is closed$"):
        await desk.submit(Job("read"))
    assert await desk.close() is None
    assert started == []


async def test_a_job_carries_what_it_was_made_with() -> None:
    before = time.monotonic()
    job = Job("save", [], {"a": 1}, wait=2.5)
    after = time.monotonic()
    assert (job.kind, job.rows, job.args, job.wait) == ("save", [], {"a": 1}, 2.5)
    assert before <= job.born <= after
    assert (job.state, job.result, job.error) == (State.QUEUED, None, None)
    assert job.task is trio.lowlevel.current_task()
    assert job.token is trio.lowlevel.current_trio_token()
    bare = Job("list")
    assert (bare.rows, bare.args, bare.wait) == ([], None, None)


async def test_a_job_is_taken_or_withdrawn_never_both() -> None:
    taken = Job("save")
    assert taken.take()
    assert not taken.withdraw()
    assert taken.state is State.TAKEN
    withdrawn = Job("save")
    assert withdrawn.withdraw()
    assert not withdrawn.take()
    assert withdrawn.state is State.WITHDRAWN
    taken.abandon()  # the caller stops waiting, taken or not
    assert state_of(taken) is State.WITHDRAWN


def state_of(job: Job) -> State:
    return job.state


def test_a_batch_leaves_out_withdrawn_jobs_and_hands_over_the_close() -> None:
    async def make() -> list[Job]:
        return [Job("save", args=number) for number in range(3)] + [Job("close")]

    jobs = trio.run(make)
    jobs[1].withdraw()
    line: queue.SimpleQueue[Job] = queue.SimpleQueue()
    for job in jobs:
        line.put(job)
    taken, closing = next_batch(line)
    assert taken == [jobs[0], jobs[2]]
    assert closing is jobs[3]
    assert [job.state for job in jobs] == [State.TAKEN, State.WITHDRAWN, State.TAKEN, State.QUEUED]
    assert line.empty()


async def test_a_memory_store_reads_a_stop_s_time_from_its_clock() -> None:
    """MemoryStore's clock decides what a stop's age is, as SqliteStore's does."""
    now = [1_700_000_000.0]
    retention = Retention(stopped_per_key=1, stopped_total=10, stopped_for=60.0)
    store = MemoryStore(retention=retention, clock=lambda: now[0])
    first, second = (stopped_record(generation) for generation in (1, 2))
    await store.save(first)
    now[0] += 30.0
    await store.save(second)
    assert list(await store.list()) == [first, second]  # 30 s old: young, kept
    now[0] += 100.0
    third = stopped_record(3)
    await store.save(third)
    assert list(await store.list()) == [third]  # the others are old by its clock


def stopped_record(generation: int) -> StoppedRecord:
    handle = Handle(
        key=Key(identity="m", instance="a"), token=f"m{generation}" * 16, generation=generation
    )
    opened = OpenRecord(handle=handle, request_id="r", lease=5.0, limits=Limits())
    return StoppedRecord.of(opened, Disposed(), Termination(kind="exited", exit=ExitStatus(code=0)))
