"""SubprocessExecution with real processes: lifecycles, trees, limits, output, identity.

These tests use the real clock (children are real processes); every wait is bounded by
``fail_after`` and none is a timing assertion. The session-wide fixture in conftest.py
fails the run if any process outlives it.
"""

from __future__ import annotations

import json
import logging
import os
import resource
import signal
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
import trio

from trio_supervisor import (
    ChildIdentity,
    ExitStatus,
    Handle,
    Key,
    Limits,
    Load,
    LoadedRecord,
    MemoryStore,
    PackageError,
    SessionRecord,
    StoppedRecord,
    SubprocessExecution,
    Supervisor,
    Termination,
    open_supervisor,
)
from trio_supervisor.executions.child._bootstrap import LEASE_SLACK
from trio_supervisor.executions.starting._unit import ProcessUnit
from trio_supervisor.executions.trees._groups import boot_id, start_time

from ..support.plugins import PLUGINS, report_in
from ..support.processes import running
from ..support.sessions import opened
from ..support.waits import BOUND, until_logged, until_stopped
from .children import MECHANISMS

RECOVERY_LOGGER = "trio_supervisor.executions.subprocess"


@pytest.fixture(params=[False, True], ids=["started", "forked"])
async def execution(
    tmp_path: Path, request: pytest.FixtureRequest
) -> AsyncIterator[SubprocessExecution]:
    """Each test runs with children started, and again forked by the fork server."""
    async with SubprocessExecution(
        tmp_path,
        entry_paths=[PLUGINS],
        commands={"sleeper": ["sleep", "30"]},
        fork_server=request.param,
    ) as subprocess_execution:
        yield subprocess_execution
        # Forked means forked: no child of a forked run was started.
        assert (subprocess_execution.fork_server_forks > 0) == request.param or not any(
            (tmp_path / "logs").iterdir()
        )


@pytest.fixture
async def sup(execution: SubprocessExecution) -> AsyncIterator[Supervisor]:
    async with open_supervisor(
        MemoryStore(), execution, lease=30.0, grace=1.0, confirmation_timeout=5.0
    ) as supervisor:
        yield supervisor


def outer_pids(tracked: int, pids: list[int]) -> list[int]:
    """Our pids for the processes a plugin named by its own (``os.getpid()``, ``.pid``).

    In a PID namespace those are pids inside it; the tracked process ``tracked`` is its
    PID 1, and /proc/PID/status says each one's pid in there. Without a namespace they
    are ours already.
    """
    namespace = os.readlink(f"/proc/{tracked}/ns/pid")
    if namespace == os.readlink("/proc/self/ns/pid"):
        return pids
    ours = {}
    for entry in Path("/proc").iterdir():
        try:
            if not entry.name.isdigit() or os.readlink(entry / "ns" / "pid") != namespace:
                continue
            status = (entry / "status").read_text()
        except OSError:
            continue  # gone meanwhile
        [line] = [line for line in status.splitlines() if line.startswith("NSpid:")]
        ours[int(line.split()[-1])] = int(entry.name)
    return [ours[pid] for pid in pids]


async def loaded_child(
    sup: Supervisor, specifier: str, **options: object
) -> tuple[Handle, LoadedRecord]:
    handle = await opened(sup, request_id=specifier, **options)  # type: ignore[arg-type]
    await sup.load(handle, Load(specifier=specifier))
    record = await sup.status(handle)
    assert isinstance(record, LoadedRecord)
    return handle, record


async def test_a_cooperative_plugin_stops_on_sigterm(
    sup: Supervisor, execution: SubprocessExecution
) -> None:
    handle, record = await loaded_child(sup, "heartbeat:main")
    pid = record.child.pid
    assert pid is not None
    assert running(pid)
    await until_logged(execution, handle, "beat 2")
    with trio.fail_after(BOUND):
        termination = await sup.dispose(handle)
    assert termination == Termination(kind="exited", exit=ExitStatus(code=0))
    assert "stopping after" in execution.logs(handle)
    assert not running(pid)


async def test_an_interrupt_right_after_start_still_ends_the_child_by_sigterm(
    sup: Supervisor,
) -> None:
    # The dispose lands while the bootstrap is still between reporting "started" and
    # entering the entry point (or just inside it): either way the child ends by SIGTERM
    # or by the plugin's own clean exit, never by an escaped KeyboardInterrupt (SIGINT).
    for attempt in range(8):
        handle = await opened(sup, request_id=f"quick-{attempt}")
        await sup.load(handle, Load(specifier="heartbeat:main"))
        with trio.fail_after(BOUND):
            termination = await sup.dispose(handle)
        assert termination.kind == "exited"
        assert termination.exit in (ExitStatus(code=0), ExitStatus(signal=signal.SIGTERM))


async def test_a_relative_state_directory_works(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    async with (
        SubprocessExecution("state", entry_paths=[PLUGINS]) as relative,
        open_supervisor(MemoryStore(), relative, lease=30.0, grace=1.0) as sup,
    ):
        handle = await opened(sup)
        await sup.load(handle, Load(specifier="heartbeat:main"))
        await until_logged(relative, handle, "beat 1")
        with trio.fail_after(BOUND):
            assert (await sup.dispose(handle)).kind == "exited"
    assert relative.log_path(handle).is_relative_to(tmp_path / "state")


async def test_a_plugin_ignoring_sigterm_is_killed_after_the_grace(
    sup: Supervisor, execution: SubprocessExecution
) -> None:
    handle, _ = await loaded_child(sup, "stubborn:main")
    await until_logged(execution, handle, "ignoring SIGTERM")  # its SIG_IGN is in place
    with trio.fail_after(BOUND):
        termination = await sup.dispose(handle)
    assert termination == Termination(kind="killed", exit=ExitStatus(signal=signal.SIGKILL))


async def test_a_crashing_plugin_ends_its_session_as_exited(
    sup: Supervisor, execution: SubprocessExecution
) -> None:
    handle = await opened(sup)
    await sup.load(handle, Load(specifier="crasher:main", config={"after": 0.2}))
    record = await until_stopped(sup, handle)
    assert record.reason.kind == "Exited"
    assert record.termination == Termination(kind="exited", exit=ExitStatus(code=1))
    assert "the crasher crashed" in execution.logs(handle)


@pytest.mark.parametrize(
    ("specifier", "words"),
    [
        (
            "nothing:main",
            "^cannot load 'nothing:main': there is no module 'nothing' on the runner's entry "
            "paths; check its name$",
        ),
        (
            "heartbeat:absent",
            "^cannot load 'heartbeat:absent': heartbeat defines no 'absent'; name a function "
            "that it defines$",
        ),
        (
            "heartbeat",
            r"^'heartbeat' is neither a configured command \(configured: [^)]*\) nor a "
            r"package\.module:function entry point whose function is a public name \(did you "
            r"mean heartbeat:main, a function main in the module heartbeat\?\)$",
        ),
        ("../etc:passwd", "neither a configured command .* nor"),
        # A remote host picks the specifier: only public names the plugin defines.
        ("heartbeat:__class__", "whose function is a public name"),
        ("heartbeat:_private", "whose function is a public name"),
        ("heartbeat:Any", "typing.Any, imported by the plugin"),
        ("heartbeat:time", "names a module, not a function"),
    ],
)
async def test_unloadable_specifiers_are_package_errors(
    sup: Supervisor, specifier: str, words: str
) -> None:
    handle = await opened(sup)
    with trio.fail_after(BOUND), pytest.raises(PackageError, match=words):
        await sup.load(handle, Load(specifier=specifier))
    record = await sup.status(handle)
    assert isinstance(record, StoppedRecord)
    assert record.reason.kind == "LoadFailed"


async def test_the_memory_limit_stops_the_hungry_plugin(
    sup: Supervisor, execution: SubprocessExecution
) -> None:
    # The limit is the tree's cgroup's here: the kernel's OOM killer ends it, and the
    # termination says so (test_tree_limits.py has the RLIMIT_AS of a runner without).
    assert "memory" in execution.cgroups.limits
    handle = await opened(sup, limits=Limits(memory_bytes=300 * 1024 * 1024))
    await sup.load(handle, Load(specifier="hungry:main"))
    record = await until_stopped(sup, handle)
    assert record.reason.kind == "Exited"
    assert record.termination.exit.signal == signal.SIGKILL
    assert record.termination.exit.oom_limit == 300 * 1024 * 1024
    assert record.termination.describe() == "exited (out of memory, limit 300 MiB)"
    assert "holding 16 MiB" in execution.logs(handle)


@pytest.mark.parametrize("leader", ["cleans up", "dies at once"])
async def test_grandchildren_that_ignore_sigterm_do_not_survive_a_dispose(
    sup: Supervisor, execution: SubprocessExecution, leader: str
) -> None:
    handle = await opened(sup)
    await sup.load(handle, Load(specifier="spawner:main", config={"leader": leader}))
    record = await sup.status(handle)
    assert isinstance(record, LoadedRecord)
    assert record.child.pid is not None
    await until_logged(execution, handle, "grandchildren")
    grandchildren = outer_pids(
        record.child.pid,
        [int(pid) for pid in execution.logs(handle).split("grandchildren")[1].split()[:2]],
    )
    assert all(running(pid) for pid in grandchildren)
    with trio.fail_after(BOUND):
        termination = await sup.dispose(handle)
    # Whether the plugin cleaned up on SIGTERM or died of it at once, its end ends what
    # it left: the grandchildren that outlived the SIGTERM are killed then, within the
    # grace, and the child exited by SIGTERM.
    assert termination.kind == "exited"
    assert termination.exit.signal == signal.SIGTERM
    assert not any(running(pid) for pid in grandchildren)
    # The termination says they had to be killed.
    assert termination.exit.descendants_killed == 2
    assert "2 descendants killed" in termination.describe()


async def test_a_named_command_runs_under_the_same_rules(
    sup: Supervisor, execution: SubprocessExecution
) -> None:
    handle = await opened(sup)
    code = await sup.load(handle, Load(specifier="sleeper"))
    assert code.origin is not None
    assert code.origin.endswith("/sleep")
    assert code.digest is not None
    assert code.digest.startswith("sha256:")
    with trio.fail_after(BOUND):
        termination = await sup.dispose(handle)
    assert termination == Termination(kind="exited", exit=ExitStatus(signal=signal.SIGTERM))


async def test_the_child_is_known_and_persisted_before_it_runs_code(sup: Supervisor) -> None:
    handle, record = await loaded_child(sup, "heartbeat:main")
    child = record.child
    assert child.adapter == "subprocess"
    assert child.pid == child.pgid
    assert child.pid is not None
    assert child.start_time == start_time(child.pid)
    assert child.boot_id == boot_id()
    assert os.getpgid(child.pid) == child.pid
    assert record.code.digest is not None
    assert record.code.origin == str(PLUGINS / "heartbeat.py")
    await sup.dispose(handle)


async def test_limits_environment_and_output_cap_are_applied(
    sup: Supervisor, execution: SubprocessExecution, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TRIO_SUPERVISOR_TEST_SECRET", "must not leak")
    monkeypatch.setenv("TZ", "UTC")  # on the allowlist: passed on
    limits = Limits(
        memory_bytes=512 * 1024 * 1024,
        cpu_seconds=30,
        open_files=64,
        file_size_bytes=10**6,
        output_bytes=4000,
    )
    handle = await opened(sup, limits=limits)
    await sup.load(handle, Load(specifier="inspector:main", config={"chatter": 10_000}))
    await until_logged(execution, handle, "output beyond")
    log = execution.logs(handle)
    report = report_in(log)
    assert report["limits"] == {
        "RLIMIT_AS": resource.RLIM_INFINITY,  # the memory limit is the tree's cgroup's
        "RLIMIT_CPU": 30,
        "RLIMIT_NOFILE": 64,
        "RLIMIT_FSIZE": 10**6,
    }
    environment = report["environment"]
    assert environment["TRIO_SUPERVISOR_IDENTITY"] == handle.key.identity
    assert environment["TRIO_SUPERVISOR_INSTANCE"] == handle.key.instance
    assert environment["TRIO_SUPERVISOR_GENERATION"] == str(handle.generation)
    assert handle.token not in json.dumps(environment)
    assert "TRIO_SUPERVISOR_TEST_SECRET" not in environment
    assert environment["TZ"] == "UTC"
    assert environment["PYTHONUNBUFFERED"] == "1"
    assert set(environment) <= {
        "PATH",
        "LANG",
        "LC_ALL",
        "LC_CTYPE",
        "TZ",
        "TMPDIR",
        "PYTHONUNBUFFERED",
    } | {name for name in environment if name.startswith("TRIO_SUPERVISOR_")}
    cap_note = "[trio_supervisor: output beyond 4000 bytes dropped]"
    assert len(log.encode()) <= 4000 + len(cap_note) + 2
    assert log.count(cap_note) == 1
    await sup.dispose(handle)


def signals_sent(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int, int]]:
    """Record every real signal this process sends from now on (probes, signal 0, are not).

    Each entry is (how, target, signal): ``kill`` to a pid, ``killpg`` to a group, or
    ``pidfd`` to a pidfd's number.
    """
    sent: list[tuple[str, int, int]] = []

    def spy(how: str, real: Callable[[int, int], None]) -> Callable[[int, int], None]:
        def send(target: int, number: int) -> None:
            if number != 0:
                sent.append((how, target, int(number)))
            real(target, number)

        return send

    monkeypatch.setattr(os, "kill", spy("kill", os.kill))
    monkeypatch.setattr(os, "killpg", spy("killpg", os.killpg))
    monkeypatch.setattr(signal, "pidfd_send_signal", spy("pidfd", signal.pidfd_send_signal))
    return sent


async def test_recovery_leaves_a_process_with_a_reused_pid_alone(
    execution: SubprocessExecution, monkeypatch: pytest.MonkeyPatch
) -> None:
    stranger = await trio.lowlevel.open_process(["sleep", "30"], start_new_session=True)
    sent = signals_sent(monkeypatch)
    try:
        real = start_time(stranger.pid)
        assert real is not None
        record = ChildIdentity(
            adapter="subprocess",
            ref="reused",
            pid=stranger.pid,
            pgid=stranger.pid,
            start_time=real - 1,  # the recorded child started earlier: not this process
            boot_id=boot_id(),
        )
        termination = await execution.recover(record)
        assert termination == Termination(kind="exited", exit=ExitStatus())
        assert sent == [], "recovery signalled a process that is not the recorded child"
        assert running(stranger.pid)
        other_boot = ChildIdentity(
            adapter="subprocess",
            ref="r",
            pid=stranger.pid,
            pgid=stranger.pid,
            start_time=real,
            boot_id="another-boot",
        )
        assert (await execution.recover(other_boot)).kind == "exited"
        assert sent == []
        assert running(stranger.pid)
    finally:
        stranger.kill()
        await stranger.wait()


async def test_recovery_kills_a_live_recorded_child_and_its_group(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async with (
        SubprocessExecution(tmp_path / "a", entry_paths=[PLUGINS]) as first,
        open_supervisor(MemoryStore(), first, lease=30.0, grace=1.0) as sup,
    ):
        handle, record = await loaded_child(sup, "spawner:main")
        await until_logged(first, handle, "grandchildren")
        assert record.child.pid is not None
        grandchildren = outer_pids(
            record.child.pid,
            [int(pid) for pid in first.logs(handle).split("grandchildren")[1].split()[:2]],
        )
        # Another execution (a restarted runner) finds the child by its identity alone.
        async with SubprocessExecution(tmp_path / "b") as second:
            with trio.fail_after(BOUND), caplog.at_level(logging.WARNING, RECOVERY_LOGGER):
                termination = await second.recover(record.child)
        assert termination.kind == "killed"
        assert termination.exit.descendants_killed == 2
        assert record.child.pid is not None
        # The orphan's kill is logged, named by its pid (recovery knows no key, no token).
        [logged] = [logged for logged in caplog.records if logged.name == RECOVERY_LOGGER]
        assert logged.levelno == logging.WARNING
        assert logged.__dict__["pid"] == record.child.pid
        assert logged.__dict__["descendants_killed"] == 2
        assert not running(record.child.pid)
        assert not any(running(pid) for pid in grandchildren)
        with trio.fail_after(BOUND):
            await until_stopped(sup, handle)
        # Found again once it is gone: nothing is signalled, and the report says so.
        async with SubprocessExecution(tmp_path / "c") as third:
            again = await third.recover(record.child)
        assert again.describe() == "exited (already gone; exit status unknown)"


async def test_the_dead_man_switch_ends_a_child_whose_unit_is_dropped(tmp_path: Path) -> None:
    handle = Handle(key=Key(identity="p", instance="a"), token="t" * 32, generation=1)
    async with SubprocessExecution(tmp_path, entry_paths=[PLUGINS]) as execution:
        unit = await execution.spawn(handle, Load(specifier="heartbeat:main"), Limits())
        assert isinstance(unit, ProcessUnit)
        await unit.renew(30.0)
        await unit.start()
        await until_logged(execution, handle, "beat 1")
        # The control socket closes, as it would if the supervisor died.
        unit._socket.close()
        with trio.fail_after(BOUND):
            status = await unit.wait()
        assert status == ExitStatus(signal=signal.SIGKILL)
        await unit.aclose()


@pytest.mark.parametrize("containment", MECHANISMS)
async def test_after_the_interrupt_the_lease_no_longer_cuts_the_grace_short(
    tmp_path: Path, containment: str
) -> None:
    # The SIGTERM itself tells the child's bootstrap that a graceful stop is under way:
    # a plugin that takes its time over it is not killed by the lease watchdog, however
    # long the grace, only by the supervisor's own kill.
    handle = Handle(key=Key(identity="p", instance="a"), token="t" * 32, generation=1)
    async with SubprocessExecution(
        tmp_path,
        entry_paths=[PLUGINS],
        containment=containment,  # type: ignore[arg-type]
    ) as execution:
        unit = await execution.spawn(handle, Load(specifier="stubborn:main"), Limits())
        await unit.renew(0.3)
        await unit.start()
        await until_logged(execution, handle, "ignoring SIGTERM")
        await unit.interrupt()
        # The watchdog would have fired 1.3 s after the renew (lease + slack).
        with trio.move_on_after(0.3 + LEASE_SLACK + 1.0):
            await unit.wait()
            raise AssertionError(f"the child ended during its grace: {await unit.wait()}")
        await unit.kill()
        with trio.fail_after(BOUND):
            assert await unit.wait() == ExitStatus(signal=signal.SIGKILL)
        await unit.aclose()


async def test_the_lease_watchdog_ends_a_child_whose_supervisor_hangs(tmp_path: Path) -> None:
    handle = Handle(key=Key(identity="p", instance="a"), token="t" * 32, generation=1)
    async with SubprocessExecution(tmp_path, entry_paths=[PLUGINS]) as execution:
        unit = await execution.spawn(handle, Load(specifier="heartbeat:main"), Limits())
        await unit.renew(0.3)
        await unit.start()
        # Nobody renews: the child kills itself 1 s (its slack) after the lease.
        with trio.fail_after(BOUND):
            status = await unit.wait()
        assert status == ExitStatus(signal=signal.SIGKILL)
        await unit.aclose()


def test_sessions_record_what_they_ran(tmp_path: Path) -> None:
    records: list[SessionRecord] = []

    async def main() -> None:
        async with SubprocessExecution(tmp_path, entry_paths=[PLUGINS]) as execution:
            store = MemoryStore()
            async with open_supervisor(store, execution, grace=1.0) as sup:
                handle = await opened(sup)
                await sup.load(handle, Load(specifier="heartbeat:main"))
                # Inside its entry point, so SIGTERM reaches it as a KeyboardInterrupt.
                await until_logged(execution, handle, "beat 1")
                await sup.dispose(handle)
            records.extend(await store.list())

    trio.run(main)
    [record] = records
    assert isinstance(record, StoppedRecord)
    assert record.reason.kind == "Disposed"
    assert record.termination == Termination(kind="exited", exit=ExitStatus(code=0))
    loaded = record.previous
    assert isinstance(loaded, LoadedRecord)
    assert loaded.code.origin == str(PLUGINS / "heartbeat.py")
    assert loaded.code.digest is not None
    assert loaded.code.digest.startswith("sha256:")
    assert loaded.child.adapter == "subprocess"
    assert loaded.child.boot_id == boot_id()


SIGNALS = Path(__file__).parent / "plugins_signals"


async def test_an_interrupt_held_while_the_plugin_sleeps_still_reaches_it(
    tmp_path: Path,
) -> None:
    # Its SIGTERM arrives where Python runs the handler only once the sleep returns (an
    # hour later): the tracked process pokes the plugin until it has ended, so the
    # interrupt still ends it well within the grace, not by the kill.
    async with (
        SubprocessExecution(tmp_path, entry_paths=[SIGNALS]) as held,
        open_supervisor(MemoryStore(), held, lease=60.0, grace=60.0) as sup,
    ):
        handle = await opened(sup)
        await sup.load(handle, Load(specifier="held:main"))
        await until_logged(held, handle, "sleeping with SIGTERM held")
        with trio.fail_after(BOUND):
            termination = await sup.dispose(handle)
        assert termination == Termination(kind="exited", exit=ExitStatus(signal=signal.SIGTERM))
        assert "interrupted" in held.logs(handle)
