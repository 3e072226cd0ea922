"""``trio-supervisor tenants``: add, list and revoke the tenants of a tenants file
(docs/service.md section D)."""

from __future__ import annotations

import datetime
import json
import os
import secrets
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

import attrs
import click
from rich.console import Console
from rich.table import Table

from .. import _defaults as defaults
from .._fields import Check
from ..service.tenants import Quota, Tenant, TenantsError, token_hash
from ..service.tenants_file import (
    locked,
    parse,
    read,
    read_text,
    replace,
    table_text,
    without_table,
)
from ._common import DEFAULTS, checked, count, print_table

# -- the tenants file: tenants add, list, revoke (docs/service.md section D) ---------------

_TENANTS_FILE: Final = DEFAULTS.state / defaults.TENANTS_FILE
_RELOAD_HINT: Final = "A running runner takes the change on SIGHUP (kill -HUP <its pid>)."
# Why a tenant needs an identity: its patterns are all it may reach (section D).
_NO_IDENTITY: Final = (
    "a tenant reaches only the key identities it is given; with none it could open nothing"
)


def _tenants_file_option(command: Any) -> Any:
    return click.option(
        "--file",
        "path",
        type=click.Path(path_type=Path, dir_okay=False),
        default=_TENANTS_FILE,
        show_default=True,
        help="The tenants file (serve --tenants FILE).",
    )(command)


def _quota_options(command: Any) -> Any:
    """A flag per field of :class:`Quota` (``--memory-bytes N``), checked by its field."""
    for field in reversed(attrs.fields(Quota)):
        flag = "--" + field.name.replace("_", "-")
        command = click.option(
            flag,
            field.name,
            type=int,
            metavar="N",
            callback=checked(field, flag),
            help=f"Quota: at most N {field.name.replace('_', ' ')} (none by default).",
        )(command)
    return command


def _refuse_input(field: str, name: str, value: object) -> None:
    """Tenant's own check of ``field``, naming the value ``name``: status 2 if it fails, so
    the command and the tenants file word a bad name alike."""
    check = getattr(attrs.fields(Tenant), field).validator
    assert isinstance(check, Check)
    try:
        check.check(name, value)
    except (TypeError, ValueError) as error:
        raise click.UsageError(str(error)) from None


def _current(path: Path, *, missing_ok: bool) -> tuple[str, dict[str, Tenant]]:
    """The tenants file's text and tenants; status 1 if it cannot work as it is."""
    if missing_ok and not path.exists():
        return "", {}
    try:
        text = read_text(path)
        data = tomllib.loads(text)
    except TenantsError as error:
        raise click.ClickException(str(error)) from None
    except tomllib.TOMLDecodeError as error:
        raise click.ClickException(f"the tenants file {path} is not TOML: {error}") from None
    if data in ({}, {"tenants": {}}):
        return text, {}  # made empty (touch): a runner refuses it, and add may fill it
    try:
        return text, dict(parse(data, str(path)).by_name)
    except TenantsError as error:
        raise click.ClickException(f"{error}; nothing was changed") from None


def _write(path: Path, text: str, intended: Mapping[str, Tenant]) -> None:
    """Replace the tenants file by ``text``, once ``text`` reads as the ``intended``
    tenants exactly; the file is never seen half written."""
    try:
        found = dict(parse(tomllib.loads(text), str(path)).by_name)
    except (TenantsError, tomllib.TOMLDecodeError) as error:
        raise click.ClickException(f"{path} would not work after the change: {error}") from None
    if found != intended:
        # Edited by its lines (add appends, revoke removes), a file laid out otherwise
        # could change more than meant: refuse rather than write it.
        raise click.ClickException(
            f"{path} is laid out in a way this command cannot change by its lines alone: "
            "edit it by hand"
        )
    try:
        replace(path, text)
    except (OSError, TenantsError) as error:
        raise click.ClickException(f"cannot write the tenants file {path}: {error}") from None


@click.group()
def tenants() -> None:
    """Edit the tenants file of serve --tenants: who may call the runner, on which keys."""


@tenants.command("add")
@click.argument("name")
@click.option(
    "--identity",
    "identities",
    multiple=True,
    metavar="PATTERN",
    help="An fnmatch pattern of the key identities the tenant may use (repeatable; at "
    f"least one: {_NO_IDENTITY}; '*' gives it every key).",
)
@_quota_options
@_tenants_file_option
def add_tenant(name: str, identities: tuple[str, ...], path: Path, **quota: int | None) -> None:
    """Add tenant NAME and print its new token, once: the file keeps only its hash."""
    _refuse_input("name", "NAME", name)
    if not identities:
        raise click.UsageError(
            f"give at least one --identity PATTERN: {_NO_IDENTITY} (--identity '*' "
            "gives it every key)"
        )
    _refuse_input("identities", "--identity", identities)
    token = secrets.token_urlsafe(32)
    tenant = Tenant(
        name=name, token_sha256=token_hash(token), identities=identities, quota=Quota(**quota)
    )
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)  # as serve makes --state
    with locked(Path(os.path.realpath(path)).parent):
        text, found = _current(path, missing_ok=True)
        if name in found:
            raise click.ClickException(
                f"tenant {name!r} is in {path} already: revoke it first to give it a new token"
            )
        if not text.strip():
            text = "# The runner's tenants (serve --tenants): docs/service.md section D.\n"
        added = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
        table = table_text(tenant, comment=f"added {added} by trio-supervisor tenants add")
        _write(path, f"{text.rstrip()}\n\n{table}", {**found, name: tenant})
    click.echo(token)
    click.echo(
        f"tenant {name!r} added to {path}. Its token is above and will not be shown again "
        f"(the file keeps only its SHA-256): give it to the tenant's hosts now. " + _RELOAD_HINT,
        err=True,
    )


@tenants.command("list")
@_tenants_file_option
@click.option("--json", "as_json", is_flag=True, help="Print the tenants as JSON.")
def list_tenants(path: Path, as_json: bool) -> None:
    """List the tenants: names, identities, quotas, ceilings (never a token's hash)."""
    try:
        found = read(path)
    except TenantsError as error:
        raise click.ClickException(str(error)) from None
    if as_json:
        shown = [
            attrs.asdict(
                tenant,
                filter=lambda field, value: field.name != "token_sha256" and value is not None,
            )
            for tenant in found
        ]
        click.echo(json.dumps(shown, indent=2))
        return
    table = Table(title=f"{count(len(found), 'tenant')} in {path}", header_style="bold")
    for column in ("tenant", "identities", "quota", "limits", "fairness"):
        table.add_column(column, no_wrap=column == "tenant")
    for tenant in found:
        table.add_row(
            tenant.name,
            ", ".join(tenant.identities),
            tenant.quota.described(),
            tenant.limits.described(),
            tenant.fairness.described(),
        )
    print_table(Console(), table)


@tenants.command("revoke")
@click.argument("name")
@_tenants_file_option
def revoke_tenant(name: str, path: Path) -> None:
    """Remove tenant NAME: its token is refused from the runner's next reading on."""
    with locked(Path(os.path.realpath(path)).parent):
        text, found = _current(path, missing_ok=False)
        if name not in found:
            raise click.ClickException(f"no tenant {name!r} in {path}")
        if len(found) == 1:
            raise click.ClickException(
                f"{name!r} is the only tenant in {path}, and a runner refuses a file without "
                "tenants: add the next tenant first"
            )
        try:
            changed = without_table(text, name)
        except TenantsError as error:
            raise click.ClickException(f"{path}: {error}; edit it by hand") from None
        _write(path, changed, {other: found[other] for other in found if other != name})
    click.echo(f"tenant {name!r} revoked from {path}")
    click.echo(_RELOAD_HINT, err=True)
