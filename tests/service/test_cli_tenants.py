"""``trio-supervisor tenants add``, ``list`` and ``revoke``: the operator's hand on the
tenants file (docs/service.md section D).

The commands run in this process through click's runner, on files in a temporary
directory; what they leave is read back with ``tenants.read``, as the runner reads it.
One real console run checks the installed command and its default file.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import stat
import subprocess
import sys
import threading
import tomllib
from pathlib import Path
from typing import Final

import pytest
from click.testing import CliRunner, Result

from trio_supervisor import Limits, cli
from trio_supervisor.service.tenants import Ceilings, Fairness, Quota, Tenant, token_hash
from trio_supervisor.service.tenants_file import parse, read, table_text

TIMEOUT: Final = 60.0  # seconds the console command may take
HASH_A: Final = "a" * 64
HASH_B: Final = "b" * 64
HASH_C: Final = "c" * 64

# A file as an operator keeps it: comments, a sub-table, limits and fairness.
KEPT: Final = f"""\
# Tenants of the build runner. Ask ops before adding one.

[tenants.acme]
token_sha256 = "{HASH_A}"   # rotated in March
identities = ["acme", "acme-*"]
quota = {{ sessions = 100, children = 20 }}
limits.default = {{ memory_bytes = 536870912 }}
limits.max = {{ memory_bytes = 2147483648, processes = 1024 }}
fairness = {{ inflight = 32, rate = 50, burst = 100 }}
"""


def tenants_file(path: Path, text: str, mode: int = 0o600) -> Path:
    path.write_text(text)
    path.chmod(mode)
    return path


def invoke(*arguments: str) -> Result:
    return CliRunner().invoke(cli.main, ["tenants", *arguments], catch_exceptions=False)


def add(path: Path, name: str, *more: str) -> Result:
    return invoke("add", name, "--identity", f"{name}-*", *more, "--file", str(path))


def left_in(directory: Path) -> list[str]:
    return sorted(entry.name for entry in directory.iterdir())


# -- add ---------------------------------------------------------------------------------


def test_add_prints_the_token_once_and_the_file_keeps_only_its_hash(tmp_path: Path) -> None:
    path = tmp_path / "state" / "tenants.toml"  # neither the directory nor the file exists
    result = add(path, "acme", "--identity", "acme")

    assert result.exit_code == 0, result.output
    token = result.stdout.strip()
    assert result.stdout == token + "\n"  # nothing else: `TOKEN=$(... tenants add ...)`
    assert re.fullmatch(r"[A-Za-z0-9_-]{43}", token)  # secrets.token_urlsafe(32)
    assert "will not be shown again" in result.stderr
    assert "kill -HUP" in result.stderr
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    text = path.read_text()
    assert token not in text
    assert token_hash(token) in text
    tenant = read(path).by_name["acme"]
    assert tenant.token_sha256 == token_hash(token)
    assert tenant.identities == ("acme-*", "acme")
    assert left_in(path.parent) == ["tenants.toml"]  # no temporary file stays behind


def test_add_each_tenant_gets_a_token_of_its_own(tmp_path: Path) -> None:
    path = tmp_path / "tenants.toml"
    tokens = {add(path, name).stdout.strip() for name in ("acme", "globex")}
    assert len(tokens) == 2
    found = read(path)
    assert {tenant.token_sha256 for tenant in found} == {token_hash(t) for t in tokens}


def test_add_writes_the_quota_flags(tmp_path: Path) -> None:
    path = tmp_path / "tenants.toml"
    flags = ("--sessions", "5", "--children", "2", "--memory-bytes", "1024")
    result = add(path, "acme", *flags, "--cpu-percent", "150")
    assert result.exit_code == 0, result.output
    assert read(path).by_name["acme"].quota == Quota(
        sessions=5, children=2, memory_bytes=1024, cpu_percent=150
    )


def test_add_keeps_the_rest_of_the_file_as_it_was(tmp_path: Path) -> None:
    path = tenants_file(tmp_path / "tenants.toml", KEPT)
    before = read(path).by_name["acme"]

    result = add(path, "globex")

    assert result.exit_code == 0, result.output
    text = path.read_text()
    assert text.startswith(KEPT)  # comments and layout included: the table is appended
    found = read(path).by_name
    assert found["acme"] == before
    assert found["globex"].token_sha256 == token_hash(result.stdout.strip())


def test_add_fills_a_file_made_empty(tmp_path: Path) -> None:
    path = tenants_file(tmp_path / "tenants.toml", "")
    assert add(path, "acme").exit_code == 0
    assert list(read(path).by_name) == ["acme"]


def test_add_keeps_the_files_mode(tmp_path: Path) -> None:
    # 0640: the runner may read it through its group; only writable by others is refused.
    path = tenants_file(tmp_path / "tenants.toml", KEPT, mode=0o640)
    assert add(path, "globex").exit_code == 0
    assert stat.S_IMODE(path.stat().st_mode) == 0o640


def test_add_an_existing_name_is_refused_and_changes_nothing(tmp_path: Path) -> None:
    path = tenants_file(tmp_path / "tenants.toml", KEPT)
    result = add(path, "acme")
    assert result.exit_code == 1
    assert result.stdout == ""  # no token printed for a tenant that was not added
    assert "tenant 'acme' is in" in result.stderr
    assert path.read_bytes() == KEPT.encode()
    assert left_in(tmp_path) == ["tenants.toml"]


@pytest.mark.parametrize(
    ("name", "pattern", "field"),
    [
        ("bad name", "x", "name"),
        ("_acme", "x", "name"),
        ("a" * 64, "x", "name"),
        ("acme", "", "identities"),
        ("acme", "x" * 129, "identities"),
    ],
)
def test_add_a_bad_name_or_pattern_is_a_usage_error_worded_as_the_files(
    tmp_path: Path, name: str, pattern: str, field: str
) -> None:
    path = tmp_path / "tenants.toml"
    result = invoke("add", name, "--identity", pattern, "--file", str(path))

    assert result.exit_code == 2
    with pytest.raises(ValueError, match=r"Tenant\.\S+ (.*)") as raised:
        Tenant(name=name, token_sha256=HASH_A, identities=(pattern,))
    assert field in str(raised.value)
    problem = str(raised.value).split(" ", 1)[1]  # "must be ...": as the file's check says
    assert problem in result.stderr
    assert not path.exists()


def test_add_a_negative_quota_is_a_usage_error(tmp_path: Path) -> None:
    path = tmp_path / "tenants.toml"
    result = add(path, "acme", "--sessions", "-1")
    assert result.exit_code == 2
    assert "--sessions must be >= 0" in result.stderr
    assert not path.exists()


def test_add_without_an_identity_is_a_usage_error_saying_why(tmp_path: Path) -> None:
    # A tenant may use only the identities it is given: with none it could open nothing,
    # and a runner refuses such a file. The error and the help say so, and name '*'.
    why = "a tenant reaches only the key identities it is given; with none it could open nothing"
    result = invoke("add", "acme", "--file", str(tmp_path / "tenants.toml"))
    assert result.exit_code == 2
    assert result.stdout == ""
    assert "Error: give at least one --identity PATTERN: " + why in result.stderr
    assert "--identity '*' gives it every key" in result.stderr
    assert left_in(tmp_path) == []
    with pytest.raises(ValueError, match="non-empty"):  # as the file's check has it
        Tenant(name="acme", token_sha256=HASH_A, identities=())
    helped = invoke("add", "--help")
    assert helped.exit_code == 0
    assert why in " ".join(helped.stdout.split())  # however click wraps it


def test_add_with_identity_star_may_use_every_key(tmp_path: Path) -> None:
    path = tmp_path / "tenants.toml"
    result = invoke("add", "acme", "--identity", "*", "--file", str(path))
    assert result.exit_code == 0, result.output
    tenant = read(path).by_name["acme"]
    assert tenant.identities == ("*",)
    assert tenant.may_use("globex")
    assert tenant.may_use("acme-eu")


BROKEN: Final = {
    "not TOML": ("[tenants.acme\n", 0o600, "is not TOML"),
    "an unknown key": (KEPT + "colour = 'red'\n", 0o600, "tenants.acme: unknown key 'colour'"),
    "writable by others": (KEPT, 0o620, "writable by others"),
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_a_broken_file_is_refused_and_nothing_is_written(tmp_path: Path, case: str) -> None:
    text, mode, problem = BROKEN[case]
    path = tenants_file(tmp_path / "tenants.toml", text, mode)
    for result in (add(path, "globex"), invoke("revoke", "acme", "--file", str(path))):
        assert result.exit_code == 1
        assert problem in result.stderr
        assert result.stdout == ""
        assert path.read_bytes() == text.encode()
        assert stat.S_IMODE(path.stat().st_mode) == mode
        assert left_in(tmp_path) == ["tenants.toml"]


def test_add_refuses_a_file_it_cannot_extend_by_appending(tmp_path: Path) -> None:
    # An inline `tenants` table cannot take a [tenants.NAME] header after it.
    text = f'tenants = {{ acme = {{ token_sha256 = "{HASH_A}", identities = ["a"] }} }}\n'
    path = tenants_file(tmp_path / "tenants.toml", text)
    result = add(path, "globex")
    assert result.exit_code == 1
    assert "would not work after the change" in result.stderr
    assert path.read_text() == text


def test_add_through_a_link_changes_the_file_it_names(tmp_path: Path) -> None:
    (tmp_path / "kept").mkdir()
    real = tenants_file(tmp_path / "kept" / "tenants.toml", "")
    link = tmp_path / "tenants.toml"
    link.symlink_to(real)
    assert add(link, "acme").exit_code == 0
    assert link.is_symlink()
    assert list(read(real).by_name) == ["acme"]


def test_add_waits_while_another_command_changes_the_file(tmp_path: Path) -> None:
    # Two commands at once would each write the file as it was plus their own change.
    path = tenants_file(tmp_path / "tenants.toml", KEPT)
    results: list[Result] = []
    held = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(held, fcntl.LOCK_EX)
        adding = threading.Thread(target=lambda: results.append(add(path, "globex")))
        adding.start()
        adding.join(timeout=0.3)
        assert adding.is_alive()
        assert path.read_text() == KEPT
    finally:
        os.close(held)
    adding.join(timeout=TIMEOUT)
    assert results[0].exit_code == 0
    assert sorted(read(path).by_name) == ["acme", "globex"]


# -- list --------------------------------------------------------------------------------


def test_list_shows_names_identities_and_quotas_never_hashes(tmp_path: Path) -> None:
    path = tenants_file(tmp_path / "tenants.toml", KEPT)
    assert add(path, "globex", "--sessions", "7").exit_code == 0
    hashes = [tenant.token_sha256 for tenant in read(path)]

    table = invoke("list", "--file", str(path))
    assert table.exit_code == 0, table.output
    for shown in ("acme", "acme, acme-*", "sessions 100, children 20", "globex", "sessions 7"):
        assert shown in table.stdout
    assert "inflight 32, rate 50, burst 100" in table.stdout

    as_json = invoke("list", "--json", "--file", str(path))
    assert as_json.exit_code == 0, as_json.output
    found = {tenant["name"]: tenant for tenant in json.loads(as_json.stdout)}
    assert found["acme"]["identities"] == ["acme", "acme-*"]
    assert found["acme"]["quota"] == {"sessions": 100, "children": 20}
    assert found["acme"]["limits"]["max"] == {"memory_bytes": 2147483648, "processes": 1024}
    assert found["globex"]["quota"] == {"sessions": 7}
    for output in (table.stdout, as_json.stdout):
        assert "token_sha256" not in output
        assert not any(sha256 in output for sha256 in hashes)


def test_list_without_a_file_is_refused(tmp_path: Path) -> None:
    result = invoke("list", "--file", str(tmp_path / "tenants.toml"))
    assert result.exit_code == 1
    assert "cannot read the tenants file" in result.stderr


# -- revoke ------------------------------------------------------------------------------

# Three tenants; globex has a sub-table and a comment of its own above its header, which
# stays when acme, above it, goes; acme's own lines and comments inside its table go.
THREE: Final = f"""\
# Tenants of the build runner.

[tenants.acme]
# the acme team's CI
token_sha256 = "{HASH_A}"
identities = ["acme-*"]

[tenants.acme.quota]
sessions = 3

# globex: the billing team, until June
[tenants.globex]
token_sha256 = "{HASH_B}"  # rotated in March
identities = ["globex"]

[tenants."initech.eu"]
token_sha256 = "{HASH_C}"
identities = ["initech-*"]
fairness = {{ rate = 2.5 }}
"""


WITHOUT_ACME: Final = f"""\
# Tenants of the build runner.

# globex: the billing team, until June
[tenants.globex]
token_sha256 = "{HASH_B}"  # rotated in March
identities = ["globex"]

[tenants."initech.eu"]
token_sha256 = "{HASH_C}"
identities = ["initech-*"]
fairness = {{ rate = 2.5 }}
"""


def test_revoke_removes_that_tenants_lines_only(tmp_path: Path) -> None:
    path = tenants_file(tmp_path / "tenants.toml", THREE)
    before = read(path).by_name

    result = invoke("revoke", "acme", "--file", str(path))

    assert result.exit_code == 0, result.output
    assert "kill -HUP" in result.stderr
    assert path.read_text() == WITHOUT_ACME
    assert dict(read(path).by_name) == {name: before[name] for name in ("globex", "initech.eu")}
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert left_in(tmp_path) == ["tenants.toml"]


def test_revoke_the_last_table_of_the_file(tmp_path: Path) -> None:
    path = tenants_file(tmp_path / "tenants.toml", THREE)
    assert invoke("revoke", "initech.eu", "--file", str(path)).exit_code == 0
    assert path.read_text() == THREE.split('[tenants."initech.eu"]')[0].rstrip() + "\n"
    assert sorted(read(path).by_name) == ["acme", "globex"]


def test_revoke_what_add_wrote(tmp_path: Path) -> None:
    path = tenants_file(tmp_path / "tenants.toml", KEPT)
    assert add(path, "globex").exit_code == 0
    assert invoke("revoke", "globex", "--file", str(path)).exit_code == 0
    assert path.read_text() == KEPT


def test_revoke_an_unknown_tenant_is_refused(tmp_path: Path) -> None:
    path = tenants_file(tmp_path / "tenants.toml", THREE)
    result = invoke("revoke", "umbrella", "--file", str(path))
    assert result.exit_code == 1
    assert "no tenant 'umbrella'" in result.stderr
    assert path.read_bytes() == THREE.encode()


def test_revoke_the_only_tenant_is_refused(tmp_path: Path) -> None:
    # A runner refuses a file without tenants and keeps the previous ones in force.
    path = tenants_file(tmp_path / "tenants.toml", KEPT)
    result = invoke("revoke", "acme", "--file", str(path))
    assert result.exit_code == 1
    assert "the only tenant" in result.stderr
    assert path.read_bytes() == KEPT.encode()


def test_revoke_refuses_a_tenant_not_written_as_a_table(tmp_path: Path) -> None:
    text = (
        "[tenants]\n"
        f'acme = {{ token_sha256 = "{HASH_A}", identities = ["a"] }}\n'
        f'globex = {{ token_sha256 = "{HASH_B}", identities = ["g"] }}\n'
    )
    path = tenants_file(tmp_path / "tenants.toml", text)
    result = invoke("revoke", "acme", "--file", str(path))
    assert result.exit_code == 1
    assert "edit it by hand" in result.stderr
    assert path.read_text() == text


# -- the table add writes ----------------------------------------------------------------


def test_a_tenants_table_reads_back_as_the_tenant() -> None:
    tenant = Tenant(
        name="initech.eu",  # a '.': the key must be quoted
        token_sha256=HASH_A,
        identities=('a"b', "back\\slash", "tab\there", "é-*", "nl\nx"),
        quota=Quota(sessions=0, cpu_percent=400),
        limits=Ceilings(default=Limits(memory_bytes=1 << 29), max=Limits(processes=64)),
        fairness=Fairness(inflight=3, rate=0.5, burst=2),
    )
    text = table_text(tenant, comment="a comment")
    assert parse(tomllib.loads(text)).by_name == {"initech.eu": tenant}


# -- the console command -----------------------------------------------------------------


def test_the_console_command_adds_to_runner_state_by_default(tmp_path: Path) -> None:
    script = Path(sys.executable).with_name("trio-supervisor")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "trio_supervisor"]
    done = subprocess.run(
        [*command, "tenants", "add", "acme", "--identity", "acme-*"],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        cwd=tmp_path,
        env={**os.environ, "NO_COLOR": "1"},
        check=False,
    )
    assert done.returncode == 0, done.stderr
    token = done.stdout.strip()
    path = tmp_path / "runner-state" / "tenants.toml"
    assert read(path).by_name["acme"].token_sha256 == token_hash(token)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
