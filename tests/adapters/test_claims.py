"""Nothing left behind: a claim names its owner, and any runner reclaims a dead owner's
(``executions/limits/_claims.py``).

Real processes: an owner is a process that runs, is a zombie, or is gone, and the
runners killed here are real ones (``plugins_isolation/holder.py``), killed with SIGKILL
once they said they hold their children. The uids they claim are of a range of the
test's own (``uids_of_this_run``), so other runners of the machine, and other runs of
the suite, claim and free theirs meanwhile without changing what a test counts.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from trio_supervisor import (
    ExecutionError,
    Key,
    Load,
    LoadedRecord,
    MemoryStore,
    SubprocessExecution,
    open_supervisor,
)
from trio_supervisor.executions.limits import _cgroups
from trio_supervisor.executions.limits._claims import (
    CGROUPS,
    UIDS,
    Claim,
    ClaimError,
    Claims,
    Owner,
    claims_root,
    running_uids,
    survey_uids,
)
from trio_supervisor.executions.trees._groups import boot_id, read_stat

from ..support.plugins import ISOLATION
from ..support.processes import launched, reap_orphans, uids_of_this_run
from ..support.waits import BOUND, settled, until

HOLDER = ISOLATION / "holder.py"
SLEEP = shutil.which("sleep") or "/bin/sleep"

as_root = pytest.mark.skipif(os.geteuid() != 0, reason="children get uids of their own as root")


# -- owners and their claims ----------------------------------------------------------------


def test_an_owner_is_alive_only_as_long_as_the_process_it_names() -> None:
    process = subprocess.Popen([SLEEP, "60"])
    try:
        stat = read_stat(process.pid)
        assert stat is not None
        boot = boot_id()
        owner = Owner(process.pid, stat.start_time, boot)
        assert owner.alive(boot)
        # The same pid, given by the kernel to a later process: another start time.
        assert not Owner(process.pid, stat.start_time + 1, boot).alive(boot)
        # The same pid and start time, of another boot.
        assert not owner.alive("00000000-0000-0000-0000-000000000000")
        process.kill()
        # A zombie holds nothing.
        settled(lambda: getattr(read_stat(process.pid), "state", "Z") == "Z", BOUND)
        assert not owner.alive(boot)
    finally:
        process.kill()
        process.wait()
    assert not owner.alive(boot)


def test_a_claim_says_its_owner_and_what_it_holds_and_an_unknown_one_is_refused() -> None:
    owner = Owner(1234, 5678, "8a0e4d4c-1f0b-4c8e-9d0f-0c6d1e2f3a4b")
    claim = Claim(owner, "/srv/state dir/children/2000000007")
    assert claim.text == (
        "owner 1234 5678 8a0e4d4c-1f0b-4c8e-9d0f-0c6d1e2f3a4b /srv/state dir/children/2000000007"
    )
    assert Claim.parse(claim.text, Path("x")) == claim
    # The format before owners were named: a bare path.
    old = Claim.parse("/srv/state/children/2000000007", Path("x"))
    assert old == Claim(None, "/srv/state/children/2000000007")
    for text in ("", "owner 12 x boot /s", "owner 12 34 boot relative", "someone else's"):
        with pytest.raises(ClaimError, match=r"the claim /c/7 says .* which is no claim"):
            Claim.parse(text, Path("/c/7"))


@as_root
def test_a_survey_reclaims_what_dead_owners_hold_and_leaves_alone_what_it_cannot_judge(
    tmp_path: Path,
) -> None:
    users = uids_of_this_run(2, 8)
    claims = Claims(tmp_path / "uids")
    claims.directory.mkdir(mode=0o700)
    children = tmp_path / "state" / "children"
    children.mkdir(parents=True)
    (tmp_path / "elsewhere" / "children").mkdir(parents=True)
    dead = subprocess.Popen(["true"])
    dead.wait()
    gone = Owner(dead.pid, 1, boot_id())  # no process has that pid and start time
    alive = subprocess.Popen([SLEEP, "60"])
    # A process that runs as a uid whose owner is gone: the uid stays taken.
    stray = subprocess.Popen([SLEEP, "60"], user=users[7], group=users[7])
    try:
        started = read_stat(alive.pid)
        assert started is not None
        living = Owner(alive.pid, started.start_time, boot_id())

        def link(uid: int, text: str) -> None:
            os.symlink(text, claims.directory / str(uid))

        link(users[0], Claim(gone, f"{tmp_path}/other/children/{users[0]}").text)
        link(users[1], Claim(living, f"{tmp_path}/other/children/{users[1]}").text)
        link(users[2], f"{tmp_path}/gone/children/{users[2]}")  # old: its state is gone
        link(users[3], f"{children}/{users[3]}")  # old: this runner's state directory
        link(users[4], f"{tmp_path}/elsewhere/children/{users[4]}")  # old: unknowable
        link(users[5], "not a claim at all")
        (claims.directory / str(users[6])).write_text("a file, no link")
        (claims.directory / "README").write_text("no uid")
        link(users[7], Claim(gone, f"{tmp_path}/other/children/{users[7]}").text)
        assert settled(lambda: users[7] in running_uids(), BOUND)

        survey = survey_uids(claims, users, children)

        assert sorted(survey.reclaimed) == [users[0], users[2], users[3]]
        assert survey.free == [users[3], users[2], users[0]]  # highest first
        assert sorted(os.listdir(claims.directory)) == sorted(
            [*(str(uid) for uid in users[4:8]), str(users[1]), "README"]
        )
        assert list(survey.unknown) == [users[4]]
        assert sorted(survey.unreadable) == sorted([str(users[5]), str(users[6]), "README"])
        assert "says 'not a claim at all', which is no claim" in survey.unreadable[str(users[5])]
        assert "cannot be read: Invalid argument" in survey.unreadable[str(users[6])]
        assert survey.strangers == {}  # the stray's uid is claimed, by a dead owner
    finally:
        for process in (alive, stray):
            process.kill()
            process.wait()
    # Once nothing runs as it any more, the dead owner's uid is reclaimed too.
    assert users[7] in survey_uids(claims, users, children).reclaimed


# -- runners that are killed ----------------------------------------------------------------


@contextlib.contextmanager
def holding(state: Path, users: range, count: int) -> Iterator[tuple[int, dict[int, int]]]:
    """A runner (``holder.py``) on ``state`` holding ``count`` children with uids of
    ``users``: its pid, and its children's tracked pids by uid. SIGKILLed at the end if
    it still runs."""
    command: list[str | Path] = [sys.executable, HOLDER, state]
    command += [f"{users.start}-{users.stop - 1}", str(count)]
    with launched(command, ready=lambda line: line == "holding\n", stop=signal.SIGKILL) as runner:
        children = {}
        for line in runner.lines[:-1]:  # "child PID UID"
            _, pid, uid = line.split()
            children[int(uid)] = int(pid)
        yield runner.process.pid, children
        runner.process.kill()
        runner.process.wait()


def claim_of(kind: str, name: object) -> Claim | None:
    """The machine's claim of ``name`` (a uid, an execution), if any."""
    path = claims_root() / kind / str(name)
    try:
        return Claim.parse(os.readlink(path), path)
    except FileNotFoundError:
        return None


def cgroups_of(state: Path) -> list[Path]:
    """The cgroups of the executions on ``state``, in every hierarchy."""
    parent = f"{_cgroups.PARENT}/{_cgroups.execution_name(state)}"
    found = [path for path in _cgroups.ROOT.glob(f"*/{parent}") if path.is_dir()]
    return sorted(found + [path for path in found for path in path.iterdir() if path.is_dir()])


def nothing_runs_as(users: range) -> bool:
    return not set(users) & set(running_uids())


@as_root
async def test_a_killed_runner_s_claims_are_reclaimed_by_a_runner_on_another_state_directory(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    users = uids_of_this_run(3, 2)
    first = tmp_path / "first"
    with holding(first, users, 2) as (pid, children):
        assert sorted(children) == list(users)
        # Its trees are stopped, so their dead-man switch cannot end them: they hold
        # their uids and cgroups after their runner is gone.
        for tracked in children.values():
            os.kill(tracked, signal.SIGSTOP)
    for uid in users:
        claim = claim_of(UIDS, uid)
        assert claim is not None
        assert claim.owner is not None
        assert claim.owner.pid == pid
        assert claim.holds == f"{first}/children/{uid}"
    held = cgroups_of(first)
    parent = claim_of(CGROUPS, _cgroups.execution_name(first))
    assert parent is not None
    assert parent.holds == str(first)
    try:
        # A runner on another state directory never takes a uid a process runs as, nor
        # a cgroup that holds one, though their runner is gone.
        async with SubprocessExecution(
            tmp_path / "second", entry_paths=[ISOLATION], isolation_users=users
        ) as second:
            assert second.isolated.free_uids == 0
        assert [claim_of(UIDS, uid) is not None for uid in users] == [True, True]
        assert cgroups_of(first) == held
    finally:
        for tracked in children.values():  # PID 1 of its namespace: its tree goes with it
            with contextlib.suppress(ProcessLookupError):
                os.kill(tracked, signal.SIGKILL)
        await until(lambda: nothing_runs_as(users), "the stopped trees gone", bound=BOUND)
        reap_orphans()
    # Once they are gone, any runner's start takes back what the dead runner held.
    with caplog.at_level(logging.INFO, "trio_supervisor.executions"):
        async with SubprocessExecution(
            tmp_path / "third", entry_paths=[ISOLATION], isolation_users=users
        ) as third:
            assert third.isolated.free_uids == 2
            assert [claim_of(UIDS, uid) for uid in users] == [None, None]
            assert cgroups_of(first) == []
            assert claim_of(CGROUPS, _cgroups.execution_name(first)) is None
    # The claims are gone either way (above). Who took them back: the third runner as it
    # started, which then names each uid with the claim it removed, unless another runner
    # of this machine (another run of the suite, or another of its workers) started in
    # between and took some back first, as any runner's start does.
    said = [record.getMessage() for record in caplog.records]
    reclaims = " ".join(line for line in said if line.startswith("reclaimed "))
    for uid in users:
        if f"{uid}, " in reclaims:
            assert f"{uid}, {first}/children/{uid} for pid {pid} " in reclaims, reclaims


@as_root
async def test_a_runner_short_of_uids_reclaims_a_killed_runner_s_before_it_refuses_a_load(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    users = uids_of_this_run(4, 1)
    async with (
        SubprocessExecution(tmp_path / "b", entry_paths=[ISOLATION], isolation_users=users) as b,
        open_supervisor(MemoryStore(), b, grace=1.0) as supervisor,
    ):
        with holding(tmp_path / "a", users, 1) as (_, children):
            assert list(children) == [users.start]
            # The holder lives: its claim stands, and the load is refused.
            record = await supervisor.open(Key(identity="short", instance="1"), "1")
            with pytest.raises(ExecutionError, match=r"every uid of .* is in use"):
                await supervisor.load(record.handle, Load(specifier="attacks:identity"))
        # Killed: its child ends by its dead-man switch; its claim is left behind.
        await until(lambda: nothing_runs_as(users), "the killed runner's tree gone", bound=BOUND)
        reap_orphans()
        # Left behind, unless another runner of the machine (another worker's test, say)
        # reclaimed it first, before or while this load looks: any runner reclaims a gone
        # runner's claims as it looks at them. Either way the load is not refused.
        with caplog.at_level(logging.INFO, "trio_supervisor.executions"):
            record = await supervisor.open(Key(identity="short", instance="2"), "2")
            await supervisor.load(record.handle, Load(specifier="attacks:identity"))
        loaded = await supervisor.status(record.handle)
        assert isinstance(loaded, LoadedRecord)
        assert loaded.child.uid == users.start
        claim = claim_of(UIDS, users.start)
        assert claim is not None
        assert claim.owner == Owner.this_process()
        said = [
            record.getMessage()
            for record in caplog.records
            if record.getMessage().startswith("reclaimed 1 uids whose runners are gone")
        ]
        # Where this runner reclaimed it, it said whose it was.
        assert all(f"{users.start}, " in message for message in said), said
        with trio.fail_after(BOUND):
            await supervisor.dispose(loaded.handle)
    assert claim_of(UIDS, users.start) is None
