"""A child reaches nothing of the runner's (``executions/limits/_isolation.py``).

Real processes, a real SqliteStore and real token files in the state directory, as
``serve`` keeps them; each test that loads runs with children started and again forked
by the fork server. Plugins attack (``plugins_isolation/attacks.py``) and print what each
attack got; every wait is bounded and answered by the plugin saying it is done.
Recovery after the runner's ``kill -9`` freeing the dead run's uids and private
directories is proved in test_containment.py (``test_a_restarted_runner_recovers_every_tree``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import trio

from trio_supervisor import (
    ExecutionError,
    Key,
    Load,
    LoadedRecord,
    MemoryStore,
    SqliteStore,
    SubprocessExecution,
    Supervisor,
    open_supervisor,
)
from trio_supervisor.executions import DEFAULT_CHILD_USERS
from trio_supervisor.executions.limits._claims import UIDS, Claim, Owner, claims_root
from trio_supervisor.executions.trees._groups import read_stat

from ..support.plugins import ISOLATION, without_the_way_down
from ..support.processes import IN_SYSTEM_TMP, uids_of_this_run
from ..support.waits import BOUND, until, until_logged
from .children import STARTS, attacks, loaded

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="children get uids of their own as root")


# The attacks on what the state directory holds, however a child is isolated.
ON_THE_STATE = {
    "read hosts-token",
    "read operator-token",
    "read the store",
    "write the store",
    "list the logs",
    "read another session's log",
    "read a token through the runner's /proc",
    "read a token through its parent's /proc",
}


@contextlib.contextmanager
def signals_to_the_runner() -> Iterator[list[int]]:
    """Every SIGUSR2 this process (the runner) gets meanwhile: the attack's signal."""
    received: list[int] = []
    previous = signal.signal(signal.SIGUSR2, lambda number, frame: received.append(number))
    try:
        yield received
    finally:
        signal.signal(signal.SIGUSR2, previous)


# How a child is started: its own interpreter, forked by the fork server, or taken
# from the standby (an interpreter started ahead, before its session was known).


@pytest.fixture(params=list(STARTS))
def start(request: pytest.FixtureRequest) -> dict[str, bool]:
    return STARTS[request.param]


@pytest.fixture
async def execution(tmp_path: Path, start: dict[str, bool]) -> AsyncIterator[SubprocessExecution]:
    """A runner's execution, its state directory laid out as ``serve`` lays it out."""
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    for name in ("hosts-token", "operator-token"):
        (state / name).write_text(f"secret {name}\n")
        (state / name).chmod(0o600)
    async with SubprocessExecution(
        state,
        entry_paths=[ISOLATION],
        fork_server=start["fork_server"],
        standby=start["standby"],
    ) as subprocess_execution:
        yield subprocess_execution
        assert (subprocess_execution.fork_server_forks > 0) == start["fork_server"]


@pytest.fixture
async def sup(execution: SubprocessExecution) -> AsyncIterator[Supervisor]:
    """Its supervisor, with the store in the state directory."""
    async with (
        SqliteStore(execution.state_directory / "supervisor.db") as store,
        open_supervisor(store, execution, lease=30.0, grace=1.0) as supervisor,
    ):
        yield supervisor


async def attacked(
    sup: Supervisor,
    execution: SubprocessExecution,
    other: LoadedRecord,
    other_home: Path,
    **config: object,
) -> LoadedRecord:
    """Load ``attacks:everything`` against the runner and the session ``other``."""
    return await loaded(
        sup,
        "attacker",
        "attacks:everything",
        state=str(execution.state_directory),
        other_log=str(execution.log_path(other.handle)),
        other_home=str(other_home),
        runner=os.getpid(),
        **config,
    )


def identity_line(execution: SubprocessExecution, record: LoadedRecord) -> list[str]:
    [line] = [line for line in execution.logs(record.handle).splitlines() if "IDENTITY" in line]
    return line.split()[1:]


async def test_every_attack_on_the_runner_is_refused_and_it_keeps_serving(
    sup: Supervisor, execution: SubprocessExecution
) -> None:
    state = execution.state_directory
    # Another tenant's session, with a log and a private directory to go after.
    other = await loaded(sup, "victim", "attacks:identity")
    await until_logged(execution, other.handle, "IDENTITY", bound=BOUND)
    assert other.child.uid is not None
    other_home = state / "children" / str(other.child.uid)  # as children see it
    assert (execution.isolated.home_of(other.child.uid) / "scratch").exists()
    with signals_to_the_runner() as received:
        record = await attacked(sup, execution, other, other_home)
        await until_logged(execution, record.handle, "done", bound=BOUND)
    # A signal that got through would have been handled by now: it is sent before "done".
    assert received == []
    outcomes = attacks(execution.logs(record.handle))
    print("\n".join(f"{name}: {said}" for name, said in outcomes.items()))
    assert outcomes.pop("write in its TMPDIR").startswith("SUCCEEDED"), outcomes
    expected = {
        *ON_THE_STATE,
        "list the state directory",
        "list the children's directories",
        "list another child's directory",
        "read the runner's environment",
        "signal the runner",
        "signal the tracked process",
        "raise an rlimit",
        "setuid(0)",
        "write under /etc",
    }
    assert set(outcomes) == expected
    outcomes = without_the_way_down(outcomes, state, record.child.uid)
    succeeded = {name: said for name, said in outcomes.items() if not said.startswith("refused")}
    assert succeeded == {}
    assert "secret" not in execution.logs(record.handle)
    assert not os.path.exists("/etc/trio-supervisor-attack")  # noqa: ASYNC240  # one stat
    # The runner is unharmed: its store and the other session are as they were, and it
    # loads and stops sessions as before.
    assert (await sup.status(other.handle)) == other
    again = await loaded(sup, "after", "attacks:identity")
    await until_logged(execution, again.handle, "IDENTITY", bound=BOUND)
    for handle in (record.handle, other.handle, again.handle):
        with trio.fail_after(BOUND):
            await sup.dispose(handle)


async def test_a_swept_child_cannot_signal_the_runner_either(tmp_path: Path) -> None:
    # In a PID namespace the runner's pid does not even exist for the child; swept, it
    # does, and the child's own uid is what refuses the signal.
    async with (
        SubprocessExecution(tmp_path, entry_paths=[ISOLATION], containment="sweep") as execution,
        open_supervisor(MemoryStore(), execution, grace=1.0) as supervisor,
    ):
        with signals_to_the_runner() as received:
            record = await loaded(
                supervisor,
                "swept",
                "attacks:everything",
                state=str(tmp_path),
                other_log="/nonexistent",
                other_home="/nonexistent",
                runner=os.getpid(),
            )
            await until_logged(execution, record.handle, "done", bound=BOUND)
        assert received == []
        outcomes = attacks(execution.logs(record.handle))
        assert outcomes["signal the runner"].startswith("refused PermissionError"), outcomes
        assert outcomes["signal the tracked process"].startswith("refused PermissionError")
        await supervisor.dispose(record.handle)


async def test_in_namespaces_of_its_own_a_child_sees_nothing_of_the_state_directory(
    tmp_path: Path, start: dict[str, bool]
) -> None:
    # What a runner that is not root gives its children ("auto" picks it there); asked
    # for here, as root, where the child's uid is root's and only the namespaces hold.
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    (state / "operator-token").write_text("secret operator-token\n")
    async with (
        SubprocessExecution(
            state,
            entry_paths=[ISOLATION],
            fork_server=start["fork_server"],
            standby=start["standby"],
            isolation="namespace",
        ) as execution,
        SqliteStore(state / "supervisor.db") as store,
        open_supervisor(store, execution, grace=1.0) as supervisor,
    ):
        assert execution.isolated.kind == "namespace"
        other = await loaded(supervisor, "victim", "attacks:identity")
        await until_logged(execution, other.handle, "IDENTITY", bound=BOUND)
        _, _, _, cwd, tmp, no_new_privs, capabilities = identity_line(execution, other)
        home = Path(cwd)
        assert (home.parent, Path(tmp)) == (state / "children", home)
        assert (no_new_privs, int(capabilities, 16)) == ("1", 0)
        # It is root here, in namespaces that do not change that: no write under /etc.
        record = await attacked(supervisor, execution, other, home, root_may_write=True)
        await until_logged(execution, record.handle, "done", bound=BOUND)
        outcomes = attacks(execution.logs(record.handle))
        # The state directory is an empty, read-only cover, but for its own directory.
        assert outcomes.pop("list the state directory") == "SUCCEEDED ['children']"
        mine = Path(str(execution.log_path(record.handle))).name  # not listed: it is logs/
        assert mine not in outcomes.pop("list the children's directories")
        assert outcomes.pop("list another child's directory").startswith("refused")
        hidden = ON_THE_STATE
        assert {
            name: outcomes[name] for name in hidden if not outcomes[name].startswith("refused")
        } == {}
        assert "secret" not in execution.logs(record.handle)
        for handle in (record.handle, other.handle):
            with trio.fail_after(BOUND):
                await supervisor.dispose(handle)


async def test_each_child_runs_as_a_uid_of_its_own_which_is_free_again_once_it_stops(
    sup: Supervisor, execution: SubprocessExecution
) -> None:
    # The private directories: a tmpfs of the children's view, which the runner reaches
    # through its descriptor.
    children = Path(f"/proc/self/fd/{execution.isolated.homes}")
    first = await loaded(sup, "first", "attacks:identity")
    second = await loaded(sup, "second", "attacks:identity")
    seen = {}
    for record in (first, second):
        await until_logged(execution, record.handle, "IDENTITY", bound=BOUND)
        uid, gid, groups, cwd, tmp, no_new_privs, capabilities = identity_line(execution, record)
        assert record.child.uid is not None
        assert record.child.uid in DEFAULT_CHILD_USERS
        assert int(uid) == int(gid) == record.child.uid
        home = execution.state_directory / "children" / uid  # as the child sees it
        assert (groups, cwd, tmp) == ("0", str(home), str(home))
        home = children / uid
        assert (no_new_privs, int(capabilities, 16)) == ("1", 0)
        assert home.stat().st_uid == record.child.uid
        assert home.stat().st_mode & 0o777 == 0o700
        seen[record.handle] = record.child.uid
    assert len(set(seen.values())) == 2, seen
    assert os.stat(children).st_mode & 0o777 == 0o711
    with trio.fail_after(BOUND):
        await sup.dispose(first.handle)
    # Its private directory goes once its termination is reported, and its uid with it.
    gone = children / str(first.child.uid)
    await until(lambda: not gone.exists(), f"{gone} removed", bound=BOUND)
    freed = first.child.uid
    assert freed is not None
    await until(lambda: execution.isolated.is_free(freed), f"{freed} free again", bound=BOUND)
    # The next it gives (other runners of the machine may claim it meanwhile: the test
    # counts on none of theirs).
    third = await loaded(sup, "third", "attacks:identity")
    assert third.child.uid not in (None, second.child.uid)
    for record in (second, third):
        with trio.fail_after(BOUND):
            await sup.dispose(record.handle)

    def left() -> set[str]:
        """The private directories there are but the standby's, made ahead for its child."""
        ready = execution._standby.ready  # white-box: what the standby was granted
        ahead = {str(ready.grant.uid)} if ready is not None and ready.grant is not None else set()
        return {home.name for home in children.iterdir()} - ahead

    await until(lambda: not left(), "every private directory removed")


async def test_a_standby_s_child_is_granted_its_uid_ahead_and_a_discarded_one_gives_it_back(
    tmp_path: Path,
) -> None:
    # The standby's uid and private directory are claimed while it waits (and its plugin's
    # namespaces made: the standby rows of every test here run through them).
    async with SubprocessExecution(
        tmp_path, entry_paths=[ISOLATION], fork_server=True, standby=True
    ) as execution:
        standby = execution._standby  # white-box: the standby, and what it was granted

        def granted() -> bool:
            return standby.ready is not None and standby.ready.grant is not None

        await until(granted, "the standby granted its uid", bound=BOUND)
        assert standby.ready is not None
        grant = standby.ready.grant
        assert grant is not None
        assert grant.uid is not None
        uid = grant.uid
        assert not execution.isolated.is_free(uid)
        home = Path(f"/proc/self/fd/{execution.isolated.homes}") / str(uid)
        assert (home.stat().st_uid, home.stat().st_mode & 0o777) == (uid, 0o700)
        claim = claims_root() / UIDS / str(uid)
        assert Claim.parse(os.readlink(claim), claim).owner == Owner.this_process()
    # Discarded as the execution ended: its claim is let go of, as a child's is.
    assert not claim.is_symlink()


async def test_a_named_command_runs_as_its_own_uid_too(
    tmp_path: Path, start: dict[str, bool]
) -> None:
    commands = {"whoami": ["sh", "-c", "id -u; pwd; echo $TMPDIR; echo done; exec sleep 3600"]}
    async with (
        SubprocessExecution(
            tmp_path, commands=commands, fork_server=start["fork_server"], standby=start["standby"]
        ) as execution,
        open_supervisor(MemoryStore(), execution, grace=1.0) as supervisor,
    ):
        record = await loaded(supervisor, "whoami", "whoami")
        await until_logged(execution, record.handle, "done", bound=BOUND)
        home = tmp_path / "children" / str(record.child.uid)
        assert execution.logs(record.handle).split() == [
            str(record.child.uid),
            str(home),
            str(home),
            "done",
        ]
        with trio.fail_after(BOUND):
            await supervisor.dispose(record.handle)


async def test_without_a_network_a_child_cannot_reach_the_runners_port(
    tmp_path: Path, start: dict[str, bool]
) -> None:
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    accepted: list[object] = []

    async def accept(stream: trio.SocketStream) -> None:
        accepted.append(stream)
        await stream.aclose()

    async with trio.open_nursery() as nursery:
        await nursery.start(trio.serve_listeners, accept, listeners)
        for network, reached in (("none", 0), ("host", 1)):
            async with (
                SubprocessExecution(
                    tmp_path / network,
                    entry_paths=[ISOLATION],
                    fork_server=start["fork_server"],
                    standby=start["standby"],
                    network=network,  # type: ignore[arg-type]
                ) as execution,
                open_supervisor(MemoryStore(), execution, grace=1.0) as supervisor,
            ):
                record = await loaded(supervisor, network, "attacks:connect", port=port)
                await until_logged(execution, record.handle, "done", bound=BOUND)
                [outcome] = attacks(execution.logs(record.handle)).values()
                assert outcome.startswith("SUCCEEDED" if reached else "refused"), outcome
                await supervisor.dispose(record.handle)
            # The one connection made is the one of the child on the host's network.
            await until(
                lambda reached=reached: len(accepted) == reached,  # type: ignore[misc]
                "the runner's accepts",
            )
        nursery.cancel_scope.cancel()


async def test_the_isolation_in_use_is_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, "trio_supervisor.executions.subprocess"):
        async with SubprocessExecution(tmp_path / "on", entry_paths=[ISOLATION]):
            pass
        async with SubprocessExecution(tmp_path / "off", isolation="none"):
            pass
        async with SubprocessExecution(tmp_path / "swept", containment="sweep"):
            pass
    said = [record.getMessage() for record in caplog.records if "isolated by" in record.message]
    assert len(said) == 3, said
    first = DEFAULT_CHILD_USERS.start
    assert f"uids {first}-{first + 1023} of their own" in said[0]
    assert str(tmp_path / "on") in said[0]  # the view covers the state directory
    assert "a fresh tmpfs each over /tmp, /var/tmp, /dev/shm" in said[0]
    assert "; a /proc of their own PID namespace; network host" in said[0]
    assert "run as the runner's user (isolation='none' was asked for)" in said[1]
    # Without a PID namespace, the log says so.
    assert "the host's /proc, with every process in it (no PID namespace: asked for)" in said[2]


async def test_without_isolation_a_child_runs_as_the_runner_in_the_state_directory(
    tmp_path: Path,
) -> None:
    async with (
        SubprocessExecution(tmp_path, entry_paths=[ISOLATION], isolation="none") as execution,
        open_supervisor(MemoryStore(), execution, grace=1.0) as supervisor,
    ):
        record = await loaded(supervisor, "plain", "attacks:identity")
        await until_logged(execution, record.handle, "IDENTITY", bound=BOUND)
        uid, _, _, cwd, *_ = identity_line(execution, record)
        assert (int(uid), cwd, record.child.uid) == (0, str(tmp_path), None)
        await supervisor.dispose(record.handle)


async def test_a_child_the_range_has_no_uid_for_is_refused_and_nothing_changes(
    tmp_path: Path,
) -> None:
    # A range of one uid, which no other test (nor runner) uses.
    only = uids_of_this_run(0)
    async with (
        SubprocessExecution(tmp_path, entry_paths=[ISOLATION], isolation_users=only) as execution,
        open_supervisor(MemoryStore(), execution, grace=1.0) as supervisor,
    ):
        first = await loaded(supervisor, "first", "attacks:identity")
        record = await supervisor.open(Key(identity="tenant", instance="second"), "second")
        with pytest.raises(ExecutionError, match=r"every uid of .* is in use .* --child-users"):
            await supervisor.load(record.handle, Load(specifier="attacks:identity"))
        homes = Path(f"/proc/self/fd/{execution.isolated.homes}")
        assert sorted(os.listdir(homes)) == [str(only.start)]
        await supervisor.dispose(first.handle)
        # Free again once its private directory is removed, just after the stop.
        home = homes / str(only.start)
        await until(lambda: not home.exists(), f"{home} removed", bound=BOUND)
        again = await supervisor.open(Key(identity="tenant", instance="third"), "third")
        await supervisor.load(again.handle, Load(specifier="attacks:identity"))
        await supervisor.dispose(again.handle)


async def test_an_entry_path_children_cannot_read_is_refused_at_start(tmp_path: Path) -> None:
    private = tmp_path / "private-plugins"
    private.mkdir(mode=0o700)
    with pytest.raises(ExecutionError, match=rf"cannot read {private}: .*chmod o\+rX"):
        async with SubprocessExecution(tmp_path / "state", entry_paths=[private]):
            pass
    assert not (tmp_path / "state" / "children").exists()


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"isolation": "uids"}, "isolation must be one of"),
        ({"network": "bridge"}, "network must be one of"),
        ({"network": "none", "isolation": "none"}, "network='none' needs isolation"),
        ({"isolation_users": range(10)}, r"within 1-4294967294 \(0 is root\), got 0-9"),
        ({"isolation_users": range(5, 5)}, "isolation_users is empty"),
        ({"isolation_users": range(1, 10, 2)}, "a range of uids with step 1"),
        ({"isolation_users": [1000]}, "a range of uids with step 1"),
    ],
)
def test_bad_isolation_options_are_refused(
    tmp_path: Path, options: dict[str, object], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        SubprocessExecution(tmp_path, **options)  # type: ignore[arg-type]


SHARED = uids_of_this_run(1, 3)


@pytest.fixture
def claims(tmp_path: Path) -> Iterator[Path]:
    """The machine's claims of uids, with two that name no runner (the format before
    owners) in SHARED: one of a state directory that is gone (stale), one of a state
    directory that is there (its runner may live)."""
    claims = claims_root() / UIDS
    claims.mkdir(mode=0o700, parents=True, exist_ok=True)
    elsewhere = tmp_path / "elsewhere" / "children"
    elsewhere.mkdir(parents=True)
    (claims / str(SHARED[0])).symlink_to(tmp_path / "gone" / "children" / str(SHARED[0]))
    (claims / str(SHARED[1])).symlink_to(elsewhere / str(SHARED[1]))
    yield claims
    for uid in SHARED:
        (claims / str(uid)).unlink(missing_ok=True)


async def test_runners_sharing_a_range_never_give_one_uid_to_two_children(
    tmp_path: Path, claims: Path
) -> None:
    async with (
        SubprocessExecution(
            tmp_path / "a", entry_paths=[ISOLATION], isolation_users=SHARED
        ) as first,
        SubprocessExecution(
            tmp_path / "b", entry_paths=[ISOLATION], isolation_users=SHARED
        ) as second,
        open_supervisor(MemoryStore(), first, grace=1.0) as one,
        open_supervisor(MemoryStore(), second, grace=1.0) as two,
    ):
        # The stale claim went at start; the other runner's is respected.
        assert (first.isolated.free_uids, second.isolated.free_uids) == (2, 2)
        a = await loaded(one, "a", "attacks:identity")
        b = await loaded(two, "b", "attacks:identity")
        assert {a.child.uid, b.child.uid} == {SHARED[0], SHARED[2]}
        home = tmp_path / "a" / "children" / str(a.child.uid)
        claim = Claim.parse(os.readlink(claims / str(a.child.uid)), claims)
        assert claim == Claim(Owner.this_process(), str(home))
        # Each runner believes one uid is left; the other runner has it.
        record = await one.open(Key(identity="tenant", instance="c"), "c")
        with pytest.raises(ExecutionError, match="every uid of"):
            await one.load(record.handle, Load(specifier="attacks:identity"))
        for supervisor, handle in ((one, a.handle), (two, b.handle)):
            await supervisor.dispose(handle)
        left = {str(a.child.uid), str(b.child.uid)}
        await until(lambda: not left & set(os.listdir(claims)), "their claims removed")


@pytest.mark.parametrize("kind", ["users", "namespace"])
async def test_a_state_directory_below_an_entry_path_in_tmp_stays_out_of_sight(
    kind: str,
) -> None:
    # A checkout in /tmp that holds the plugins and the state directory too: the child's
    # fresh /tmp has the entry path mounted back, and the state directory covered in it.
    with tempfile.TemporaryDirectory(prefix=IN_SYSTEM_TMP, dir="/tmp") as directory:
        base = Path(directory)
        os.chmod(base, 0o755)  # an entry path others may read
        for plugin in ISOLATION.glob("*.py"):
            shutil.copy(plugin, base)
        state = base / "state"
        state.mkdir(mode=0o700)
        (state / "operator-token").write_text("secret operator-token\n")
        async with (
            SubprocessExecution(state, entry_paths=[base], isolation=kind) as execution,  # type: ignore[arg-type]
            open_supervisor(MemoryStore(), execution, grace=1.0) as supervisor,
        ):
            assert str(base) in execution.isolated.keep or kind == "users"
            other = await loaded(supervisor, "victim", "attacks:identity")
            await until_logged(execution, other.handle, "IDENTITY", bound=BOUND)
            home = Path(identity_line(execution, other)[3])
            record = await attacked(
                supervisor, execution, other, home, root_may_write=kind == "namespace"
            )
            await until_logged(execution, record.handle, "done", bound=BOUND)
            outcomes = attacks(execution.logs(record.handle))
            listing = outcomes.pop("list the state directory")
            assert listing.startswith("refused") or listing == "SUCCEEDED ['children']"
            assert not {
                name: outcomes[name]
                for name in ON_THE_STATE
                if name in outcomes and not outcomes[name].startswith("refused")
            }
            assert "secret" not in execution.logs(record.handle)
            for handle in (record.handle, other.handle):
                with trio.fail_after(BOUND):
                    await supervisor.dispose(handle)


def _plugin_ahead(execution: SubprocessExecution) -> tuple[int, int] | None:
    """The standby's T and the plugin it forked ahead (its one child, in a process group
    and mount namespace of its own, still root), once there are both."""
    ready = execution._standby.ready  # white-box: what the next load takes
    if ready is None or ready.grant is None:
        return None
    tracked = ready.process.pid
    below = [
        pid
        for pid in (int(entry) for entry in os.listdir("/proc") if entry.isdigit())
        if (stat := read_stat(pid)) is not None and stat.ppid == tracked
    ]
    if len(below) != 1:
        return None
    plugin = below[0]
    try:
        own = os.readlink(f"/proc/{plugin}/ns/mnt") != os.readlink(f"/proc/{tracked}/ns/mnt")
    except OSError:
        return None
    stat = read_stat(plugin)
    return (tracked, plugin) if own and stat is not None and stat.pgid == plugin else None


@contextlib.asynccontextmanager
async def standing_by(
    tmp_path: Path,
) -> AsyncIterator[tuple[Supervisor, SubprocessExecution, int, int]]:
    """A supervisor over an execution whose standby waits with its plugin forked ahead:
    the supervisor, the execution, and the standby's T and P."""
    async with (
        SubprocessExecution(
            tmp_path, entry_paths=[ISOLATION], fork_server=True, standby=True
        ) as execution,
        open_supervisor(MemoryStore(), execution, lease=30.0, grace=1.0) as sup,
    ):
        tracked, plugin = await until(
            lambda: _plugin_ahead(execution), "a plugin forked ahead", bound=BOUND
        )
        yield sup, execution, tracked, plugin


async def loaded_as_its_uid(
    sup: Supervisor, execution: SubprocessExecution, instance: str
) -> LoadedRecord:
    """A child loaded with ``attacks:identity``, once it said it runs as its own uid."""
    record = await loaded(sup, instance, "attacks:identity")
    await until_logged(execution, record.handle, "IDENTITY", bound=BOUND)
    said = next(line for line in execution.logs(record.handle).splitlines() if "IDENTITY" in line)
    assert said.split()[1:3] == [str(record.child.uid)] * 2
    return record


async def test_a_standby_s_plugin_is_forked_ahead_in_namespaces_of_its_own_and_runs_the_load(
    tmp_path: Path,
) -> None:
    # Its fork, the copy of the view and its mounts are then not the load's.
    async with standing_by(tmp_path) as (sup, execution, tracked, plugin):
        assert os.stat(f"/proc/{plugin}").st_uid == 0  # root until its load names the uid
        record = await loaded_as_its_uid(sup, execution, "ahead")
        assert record.child.pid == tracked
        # The very process forked ahead runs the plugin, as the child's uid.
        assert os.stat(f"/proc/{plugin}").st_uid == record.child.uid
        with trio.fail_after(BOUND):
            await sup.dispose(record.handle)
        assert read_stat(plugin) is None


async def test_a_plugin_forked_ahead_that_died_is_replaced_by_a_fresh_fork_at_the_load(
    tmp_path: Path,
) -> None:
    async with standing_by(tmp_path) as (sup, execution, tracked, plugin):
        os.kill(plugin, signal.SIGKILL)
        # Dead before the load (T reaps it only then): one that dies during the load
        # fails it, as a plugin forked at the load that dies before it started does.
        await until(
            lambda: (stat := read_stat(plugin)) is not None and stat.state == "Z",
            "the plugin forked ahead is dead",
            bound=BOUND,
        )
        record = await loaded_as_its_uid(sup, execution, "replaced")
        assert record.child.pid == tracked
        with trio.fail_after(BOUND):
            await sup.dispose(record.handle)
