"""``trio-supervisor serve``'s flags and its TOML file: one of each per RunnerConfig field.

The flags and the file's keys are made from ``RunnerConfig``'s fields, so these tests
drive the command itself (click's runner, in this process) with each field given as a
flag and as a key, and look at the configuration the runner would have been started
with: the runner's start is replaced by one that records its configuration, and
logging's set-up by one that records the format (the test process keeps its own).
The edges that need a real process (a taken port, a missing plugins directory) run the
console command.
"""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path
from typing import Any, Final

import attrs
import pytest
import trio
from click.testing import CliRunner

from trio_supervisor import Key, Limits, StaleSessionError, cli
from trio_supervisor.cli import _serve as cli_serve
from trio_supervisor.service import runner
from trio_supervisor.service.config import RunnerConfig
from trio_supervisor.service.tenants import Ceilings

from ..support.runners import Runner, heartbeat_heard, serving

TIMEOUT: Final = 60.0  # seconds one command may take
FLEET: Final = "postgresql://postgres@127.0.0.1:5432/fleet"  # never reached: serve is replaced


@attrs.frozen
class Sample:
    """A value for one field, other than its default: as flags, as TOML, as read."""

    flags: tuple[str, ...]
    toml: str
    value: Any


def samples(tmp: Path) -> dict[str, Sample]:
    """A sample per field of RunnerConfig (the test fails when a field has none)."""
    plugins = tmp / "plugins"
    plugins.mkdir(exist_ok=True)
    tenants = tmp / "tenants.toml"
    tenants.touch()  # it must exist; serve is replaced, so it is never read
    return {
        "state": Sample(("--state", str(tmp / "s")), f'state = "{tmp / "s"}"', tmp / "s"),
        "listen": Sample(("--listen", "127.0.0.1:0"), 'listen = "127.0.0.1:0"', "127.0.0.1:0"),
        "plugins": Sample(("--plugins", str(plugins)), f'plugins = ["{plugins}"]', (plugins,)),
        "commands": Sample(
            ("--command", "nap=sleep 600"),
            '[commands]\nnap = ["sleep", "600"]',
            {"nap": ("sleep", "600")},
        ),
        "lease": Sample(("--lease", "7.5"), "lease = 7.5", 7.5),
        "grace": Sample(("--grace", "0"), "grace = 0", 0.0),
        "confirmation_timeout": Sample(
            ("--confirmation-timeout", "2"), "confirmation-timeout = 2", 2.0
        ),
        "token_file": Sample(
            ("--token-file", str(tmp / "t")), f'token_file = "{tmp / "t"}"', tmp / "t"
        ),
        "operator_token_file": Sample(
            ("--operator-token-file", str(tmp / "o")),
            f'operator_token_file = "{tmp / "o"}"',
            tmp / "o",
        ),
        "certfile": Sample(
            ("--certfile", str(tmp / "c"), "--keyfile", str(tmp / "k")),
            f'certfile = "{tmp / "c"}"\nkeyfile = "{tmp / "k"}"',
            tmp / "c",
        ),
        "keyfile": Sample(
            ("--keyfile", str(tmp / "k"), "--certfile", str(tmp / "c")),
            f'keyfile = "{tmp / "k"}"\ncertfile = "{tmp / "c"}"',
            tmp / "k",
        ),
        "insecure_http": Sample(("--insecure-http",), "insecure_http = true", True),
        "standby": Sample(("--no-standby",), "standby = false", False),
        "fork_server": Sample(("--no-fork-server",), "fork-server = false", False),
        "isolation": Sample(("--isolation", "none"), 'isolation = "none"', "none"),
        "child_users": Sample(
            ("--child-users", "100000-101023"),
            'child-users = "100000-101023"',
            range(100000, 101024),
        ),
        "child_network": Sample(("--child-network", "none"), 'child_network = "none"', "none"),
        "log_format": Sample(("--log-format", "json"), 'log_format = "json"', "json"),
        "store": Sample(("--store", FLEET), f'store = "{FLEET}"', FLEET),
        "runner_id": Sample(("--runner-id", "r1"), 'runner_id = "r1"', "r1"),
        "advertise": Sample(
            ("--advertise", "https://r1.example:8470", "--store", FLEET),
            f'advertise = "https://r1.example:8470"\nstore = "{FLEET}"',
            "https://r1.example:8470",
        ),
        "runner_lease": Sample(
            ("--runner-lease", "30", "--store", FLEET),
            f'runner-lease = 30\nstore = "{FLEET}"',
            30.0,
        ),
        "tenants": Sample(("--tenants", str(tenants)), f'tenants = "{tenants}"', tenants),
        "max_children": Sample(("--max-children", "3"), "max-children = 3", 3),
        "reserve_memory": Sample(
            ("--reserve-memory", "1048576"), "reserve_memory = 1048576", 1048576
        ),
        "drain_on_sigterm": Sample(("--drain-on-sigterm", "120"), "drain_on_sigterm = 120", 120.0),
        "store_wait": Sample(("--store-wait", "2.5"), "store-wait = 2.5", 2.5),
        "store_commit_window": Sample(
            ("--store-commit-window", "0.02", "--store", FLEET),
            f'store-commit-window = 0.02\nstore = "{FLEET}"',
            0.02,
        ),
        "restart_limit": Sample(("--restart-limit", "3/60"), 'restart-limit = "3/60"', "3/60"),
        "retain_per_key": Sample(("--retain-per-key", "3"), "retain-per-key = 3", 3),
        "retain_total": Sample(("--retain-total", "500"), "retain_total = 500", 500),
        # A duration: units, or seconds (a TOML number is seconds).
        "retain_for": Sample(("--retain-for", "1h30m"), 'retain-for = "90m"', 5400.0),
        # A table of the file's alone: no flag (docs/service.md D).
        "limits": Sample(
            (),
            "[limits]\ndefault = { memory_bytes = 1048576 }\nmax = { processes = 9 }",
            Ceilings(default=Limits(memory_bytes=1048576), max=Limits(processes=9)),
        ),
    }


@attrs.define
class Started:
    """What ``serve`` would have started the runner with."""

    configs: list[RunnerConfig] = attrs.field(factory=list)
    log_formats: list[str] = attrs.field(factory=list)


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch) -> Started:
    seen = Started()

    async def run_runner(config: RunnerConfig) -> int:
        await trio.lowlevel.checkpoint()
        seen.configs.append(config)
        return 0

    monkeypatch.setattr(cli_serve, "run_runner", run_runner)
    monkeypatch.setattr(cli_serve, "configure_logging", seen.log_formats.append)
    return seen


def serve(*arguments: str) -> tuple[int, str]:
    result = CliRunner().invoke(cli.main, ["serve", *arguments])
    return result.exit_code, result.output


def test_every_runner_config_field_is_a_serve_flag_and_a_toml_key(
    tmp_path: Path, started: Started
) -> None:
    fields = attrs.fields_dict(RunnerConfig)
    given = samples(tmp_path)
    assert set(given) == set(fields), "a field of RunnerConfig has no sample here"
    status, help_text = serve("--help")
    assert status == 0
    flagless = 0
    for name, sample in given.items():
        assert sample.value != fields[name].default, name  # a sample shows the flag works
        if not sample.flags:
            flagless += 1
            assert f"--{name}" not in help_text, name
        else:
            assert sample.flags[0].removeprefix("--no-") in help_text.replace("--no-", "--"), name
            status, output = serve(*sample.flags)
            assert status == 0, (name, output)
            assert getattr(started.configs[-1], name) == sample.value, name

        config = tmp_path / f"{name}.toml"
        config.write_text(sample.toml + "\n")
        status, output = serve("--config", str(config))
        assert status == 0, (name, output)
        assert getattr(started.configs[-1], name) == sample.value, name
    # Logging is set up as configured: json twice (the flag's, the key's), else text.
    assert sorted(started.log_formats) == ["json"] * 2 + ["text"] * (len(given) * 2 - 2 - flagless)


def test_standby_false_in_a_config_file_is_a_standby_turned_off(
    tmp_path: Path, started: Started
) -> None:
    config = tmp_path / "runner.toml"
    config.write_text("standby = false\nfork_server = false\n")
    status, output = serve("--config", str(config))
    assert status == 0, output
    assert (started.configs[-1].standby, started.configs[-1].fork_server) == (False, False)
    # A flag wins over its key.
    status, output = serve("--config", str(config), "--standby")
    assert status == 0, output
    assert (started.configs[-1].standby, started.configs[-1].fork_server) == (True, False)


def test_isolation_keys_in_a_config_file_and_the_flags_that_win_over_them(
    tmp_path: Path, started: Started
) -> None:
    config = tmp_path / "runner.toml"
    config.write_text('child_users = "5000-5999"\nchild-network = "none"\n')
    status, output = serve("--config", str(config))
    assert status == 0, output
    chosen = started.configs[-1]
    assert (chosen.isolation, chosen.child_users, chosen.child_network) == (
        "auto",
        range(5000, 6000),
        "none",
    )
    status, output = serve(
        "--config", str(config), "--child-users", "7-7", "--child-network", "host"
    )
    assert status == 0, output
    assert (started.configs[-1].child_users, started.configs[-1].child_network) == (
        range(7, 8),
        "host",
    )
    # Without either, the execution's own uids, and the runner's network.
    status, output = serve()
    assert status == 0, output
    chosen = started.configs[-1]
    assert (chosen.isolation, chosen.child_users, chosen.child_network) == ("auto", None, "host")


@pytest.mark.parametrize(
    ("text", "users"),
    [
        ("1-1", range(1, 2)),  # one uid: one child at a time
        ("100000-101023", range(100000, 101024)),
        (" 2000000000 - 2000001023 ", range(2000000000, 2000001024)),
        ("4294967294-4294967294", range(4294967294, 4294967295)),  # the last uid there is
    ],
)
def test_child_users_are_first_to_last_both_included(
    started: Started, text: str, users: range
) -> None:
    status, output = serve("--child-users", text)
    assert status == 0, output
    assert started.configs[-1].child_users == users


@pytest.mark.parametrize(
    ("flags", "passed"),
    [
        ((), {"isolation": "auto", "network": "host"}),  # the execution's own uids
        (("--isolation", "none"), {"isolation": "none", "network": "host"}),
        (
            ("--child-users", "100-199", "--child-network", "none"),
            {"isolation": "auto", "network": "none", "isolation_users": range(100, 200)},
        ),
    ],
)
def test_the_execution_is_made_with_the_isolation_configured(
    tmp_path: Path,
    started: Started,
    monkeypatch: pytest.MonkeyPatch,
    flags: tuple[str, ...],
    passed: dict[str, Any],
) -> None:
    status, output = serve("--state", str(tmp_path), *flags)
    assert status == 0, output
    made: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
    monkeypatch.setattr(
        runner, "SubprocessExecution", lambda *args, **kwargs: made.append((args, kwargs))
    )
    runner._execution(started.configs[-1])  # no child starts: the execution is a recorder
    assert made == [
        (
            (tmp_path,),
            {"entry_paths": [], "commands": {}, "standby": True, "fork_server": True, **passed},
        )
    ]


@pytest.mark.parametrize(
    ("toml", "words"),
    [
        ("colour = 'red'", "unknown key 'colour' in "),
        ("lease = 0.05", "lease (in "),  # the key is named, then the same words as a flag's
        ("lease = 'long'", "'long' is not a valid float"),
        ("plugins = 'one'", "plugins must be an array"),
        ("commands = ['sleep']", "commands must be a table of NAME = [ARGV...]"),
        ("lease = ", "--config"),  # not TOML
        ("child-users = '0-1023'", "child_users (in "),
        ("child_users = 5000", "'--child-users': expected FIRST-LAST, two uids, got 5000"),
        ("isolation = 'root'", "'root' is not one of 'auto', 'users', 'namespace', 'none'"),
        ("retain-per-key = 0", "retain_per_key (in "),
        ("retain_for = 'soon'", "'--retain-for': expected a duration such as 90s"),
        ("retain_for = -1", "retain_for (in "),
    ],
)
def test_a_bad_config_file_is_a_usage_error_naming_the_key(
    tmp_path: Path, started: Started, toml: str, words: str
) -> None:
    config = tmp_path / "runner.toml"
    config.write_text(toml + "\n")
    status, output = serve("--config", str(config))
    assert status == 2, output
    assert words in output, output
    assert started.configs == []


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (
            ("--lease", "0.05"),
            "Error: --lease must be a finite number of seconds >= 0.1 and <= 1000000000, "
            "got 0.05\n",
        ),
        (
            ("--grace", "-1"),
            "Error: --grace must be a finite number of seconds >= 0, got -1.0\n",
        ),
        (("--command", "nap"), "expected NAME=ARGV, got 'nap'"),
        (("--log-format", "xml"), "'xml' is not one of 'text', 'json'"),
        (("--certfile", "c"), "--certfile and --keyfile go together"),
        (("--isolation", "off"), "'off' is not one of 'auto', 'users', 'namespace', 'none'"),
        (("--child-network", "bridge"), "'bridge' is not one of 'host', 'none'"),
        (
            ("--isolation", "namespace", "--child-users", "5000-5001"),
            "--child-users is for children with uids of their own: it needs --isolation users "
            "or auto (namespace keeps the runner's uid)",
        ),
        (
            ("--child-users", "5000"),
            "Error: Invalid value for '--child-users': expected FIRST-LAST, two uids, got '5000'\n",
        ),
        (
            ("--child-users", "first-last"),
            "Error: Invalid value for '--child-users': expected FIRST-LAST, two uids, got "
            "'first-last'\n",
        ),
        (
            ("--child-users", "5000-6000-7000"),
            "Error: Invalid value for '--child-users': expected FIRST-LAST, two uids, got "
            "'5000-6000-7000'\n",
        ),
        (
            ("--child-users", "-5-10"),
            "Error: --child-users must be two uids FIRST-LAST, neither negative, got -5-10\n",
        ),
        (
            ("--child-users", "5--10"),
            "Error: --child-users must be two uids FIRST-LAST, neither negative, got 5--10\n",
        ),
        (
            ("--child-users", "0-1023"),
            "Error: --child-users must not start at 0, root's uid, got 0-1023\n",
        ),
        (
            ("--child-users", "6000-5000"),
            "Error: --child-users must be FIRST-LAST with FIRST <= LAST, got 6000-5000\n",
        ),
        (
            ("--child-users", "1-4294967295"),
            "Error: --child-users must end at 4294967294 at most (uids are 32 bits, and "
            "4294967295 means 'unchanged' to setuid), got 1-4294967295\n",
        ),
        (
            ("--child-users", "4294967296-4294967300"),
            "Error: --child-users must end at 4294967294 at most (uids are 32 bits, and "
            "4294967295 means 'unchanged' to setuid), got 4294967296-4294967300\n",
        ),
        (
            ("--isolation", "none", "--child-users", "5000-5999"),
            "Error: --child-users is for isolated children: it needs --isolation auto\n",
        ),
        (
            ("--restart-limit", "5 per 600"),
            "--restart-limit must be N/SECONDS (N >= 0 restarts within 0 < SECONDS <= "
            "86400, as 5/600), got '5 per 600'",
        ),
        (("--store-wait", "-1"), "-1"),
        (("--retain-per-key", "0"), "Error: --retain-per-key must be >= 1, got 0\n"),
        (("--retain-total", "-3"), "Error: --retain-total must be >= 1, got -3\n"),
        (
            ("--retain-for", "-90"),
            "Error: --retain-for must be a finite number of seconds >= 0, got -90.0\n",
        ),
        (
            ("--retain-for", "an hour"),
            "Error: Invalid value for '--retain-for': expected a duration such as 90s, 30m, "
            "1h or 1h30m, or seconds, got 'an hour'\n",
        ),
        (("--store-commit-window", "2", "--store", FLEET), "2"),
        (
            ("--store-commit-window", "0.01"),
            "--store-commit-window is for a fleet: it needs --store postgresql://...",
        ),
        (
            ("--isolation", "none", "--child-network", "none"),
            "Error: --child-network none is for isolated children: it needs --isolation auto "
            "(with --isolation none, children use the runner's network)\n",
        ),
    ],
)
def test_a_bad_flag_is_a_usage_error_naming_it(
    started: Started, flags: tuple[str, ...], words: str
) -> None:
    status, output = serve(*flags)
    assert status == 2, output
    assert words in output, output
    assert started.configs == []


def run(*arguments: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "trio_supervisor", *arguments],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        cwd=cwd,
        check=False,
    )


def test_plugins_that_do_not_exist_are_refused_before_anything_starts(tmp_path: Path) -> None:
    done = run("serve", "--plugins", "/nonexistent", "--listen", "127.0.0.1:0", cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert "Error: Invalid value for '--plugins': Directory '/nonexistent' does not exist." in (
        done.stderr
    )
    assert done.stdout == ""
    assert not (tmp_path / "runner-state").exists()  # nothing was made


def test_a_port_in_use_is_one_line_saying_so_and_exit_status_1(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        address = f"127.0.0.1:{taken.getsockname()[1]}"
        done = run("serve", "--listen", address, "--no-standby", "--no-fork-server", cwd=tmp_path)
    assert done.returncode == 1, done.stderr
    assert done.stdout == ""  # it never listened
    assert "Traceback" not in done.stderr, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("Error")]
    assert errors == [
        f"Error: cannot listen on {address}: the address is already in use (another "
        "runner?); give --listen another HOST:PORT, or port 0 for a free one"
    ], done.stderr


def test_a_runner_keeps_the_stopped_generations_retain_per_key_says_with_their_logs(
    tmp_path: Path,
) -> None:
    """With --retain-per-key 3, the three newest Stopped generations of a key stay
    readable, records and logs; a fourth stop evicts the first, and its log."""
    key = Key(identity="acme", instance="kept")
    flags = ("--retain-per-key", "3", "--no-standby")

    async def four_generations(served: Runner) -> None:
        async with served.host() as host, served.operator() as operators:
            for generation in (1, 2, 3, 4):
                await host.dispose(await heartbeat_heard(host, operators, key, generation))
                if generation == 3:
                    kept = [await operators.logs(key, g) for g in (1, 2, 3)]
                    assert all(f"beat 1 of acme/kept #{g}\n" in kept[g - 1] for g in (1, 2, 3))
            async with served.http() as http:
                query = {"identity": "acme", "instance": "kept", "all_generations": "true"}
                answer = await http.get("/v1/sessions", params=query)
            assert answer.status_code == 200, answer.text
            stopped = sorted(
                (record["handle"]["generation"], record["phase"])
                for record in answer.json()["sessions"]
            )
            assert stopped == [(2, "Stopped"), (3, "Stopped"), (4, "Stopped")]
            for generation in (2, 3, 4):
                assert f"beat 1 of acme/kept #{generation}\n" in await operators.logs(
                    key, generation
                )
            with pytest.raises(StaleSessionError, match="no retained generation 1"):
                await operators.logs(key, 1)

    with serving(tmp_path / "state", *flags) as served:
        trio.run(four_generations, served)
