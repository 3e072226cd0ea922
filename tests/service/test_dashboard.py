"""The dashboard (``GET /``), driven in a real headless Chromium (docs/service.md section B).

An operator opens the runner's page, signs in once with the operators' token, sees the
sessions live, opens one to read its record and its log tail, and disposes one with its
button; on a runner with tenants (section D), each tenant's usage against its quota and
the runner's children and memory against its capacity. The browser is Debian's Chromium
(``/usr/bin/chromium``), driven by Playwright's sync API; Playwright never downloads a
browser here, and a machine without Chromium fails this test rather than skip it: the
page is only known to work where it ran.

The page may reach nothing but the runner (no external assets), and logs no error.
"""

from __future__ import annotations

import contextlib
import functools
import re
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Final

import pytest
import trio
from playwright.sync_api import (
    ConsoleMessage,
    Page,
    Request,
    ViewportSize,
    expect,
    sync_playwright,
)

from trio_supervisor import Key, Load
from trio_supervisor.service.tenants import token_hash

from ..support import LEASE, Runner, open_sessions, serving

CHROMIUM_ARGS: Final = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
    "--disable-sync",
)
VIEWPORT: Final = ViewportSize(width=1360, height=820)
WAIT: Final = 15_000  # milliseconds an expectation may take (the page lists every 2 s)
ACME_TOKEN: Final = "acme-token-for-the-dashboard"
GLOBEX_TOKEN: Final = "globex-token-for-the-dashboard"
TENANTS: Final = f"""
[tenants.acme]
token_sha256 = "{token_hash(ACME_TOKEN)}"
identities = ["acme", "acme-*"]
quota = {{ sessions = 2, children = 2, memory_bytes = 2147483648 }}
limits.default = {{ memory_bytes = 536870912 }}

[tenants.globex]
token_sha256 = "{token_hash(GLOBEX_TOKEN)}"
identities = ["globex"]
"""


def chromium() -> str:
    """The system's Chromium; the test fails, saying what to install, without one."""
    path = shutil.which("chromium")
    if path is None:
        pytest.fail(
            "Chromium is not installed (no `chromium` on PATH): the dashboard is tested in a "
            "real browser. Install Debian's package: apt-get install chromium",
            pytrace=False,
        )
    return path


def sign_in(page: Page, runner: Runner) -> None:
    page.goto(runner.url + "/")
    expect(page.get_by_role("heading", name="Sign in")).to_be_visible()
    page.get_by_label("Operator token").fill(runner.operator_token)
    page.get_by_role("button", name="Sign in").click()


@contextlib.contextmanager
def browsing(runner: Runner) -> Iterator[Page]:
    """A page in a headless Chromium, for ``runner``; on the way out, fails if the page
    reached anything but the runner or logged an error."""
    executable = chromium()
    elsewhere: list[str] = []
    errors: list[str] = []

    def requested(request: Request) -> None:
        if not request.url.startswith(runner.url + "/"):
            elsewhere.append(request.url)

    def logged(message: ConsoleMessage) -> None:
        if message.type == "error":
            errors.append(message.text)

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=executable, headless=True, args=list(CHROMIUM_ARGS)
        )
        try:
            page = browser.new_page(viewport=VIEWPORT)
            page.set_default_timeout(WAIT)
            page.on("request", requested)
            page.on("console", logged)
            page.on("pageerror", lambda error: errors.append(str(error)))
            yield page
        finally:
            browser.close()
    assert not elsewhere, f"the page reached outside the runner: {elsewhere}"
    assert not errors, f"the page logged errors: {errors}"


async def open_as(runner: Runner, token: str, key: Key, *, load: bool) -> None:
    """Open a session of ``key`` with a tenant's ``token``; load ``heartbeat:main`` in it."""
    async with runner.host(token) as host:
        record = await host.open(key, f"open-{uuid.uuid4()}", lease=LEASE)
        if load:
            await host.load(record.handle, Load(specifier="heartbeat:main"))


def test_an_operator_signs_in_sees_the_sessions_reads_one_and_disposes_one(
    tmp_path: Path,
) -> None:
    with serving(tmp_path / "state", "--runner-id", "dash-1") as runner:
        trio.run(functools.partial(open_sessions, runner, 3, loaded=3))
        with browsing(runner) as page:
            sign_in(page, runner)
            sessions = page.get_by_role("row").filter(has_text="acme/")
            expect(sessions).to_have_count(3, timeout=WAIT)
            for number in (1, 2, 3):
                row = sessions.filter(has_text=f"acme/eu-{number}")
                expect(row.get_by_text("Loaded", exact=True)).to_be_visible()
                expect(row.get_by_text("dash-1", exact=True)).to_be_visible()  # its runner
            # The fleet's runners: this one alone, alive, holding the three sessions.
            runners = page.get_by_role("table", name="Runners").get_by_role("row")
            expect(runners).to_have_count(2)  # the header, and this runner
            this_one = runners.filter(has_text="dash-1")
            expect(this_one.get_by_text("alive", exact=True)).to_be_visible()
            expect(this_one.get_by_text(runner.url, exact=True)).to_be_visible()
            expect(this_one.get_by_role("cell").nth(6)).to_have_text("3")  # sessions
            expect(this_one.get_by_role("cell").nth(7)).to_have_text(re.compile(r"^3 / \d+$"))
            # Without a tenants file, the hosts' token is one tenant with no quota.
            default = page.get_by_role("table", name="Tenants").get_by_role("row")
            expect(default.filter(has_text="default")).to_contain_text("3 / no quota")
            # Live: the page follows the runner's events, and a new session shows up.
            expect(page.get_by_role("banner").get_by_text("live", exact=True)).to_be_visible()
            trio.run(functools.partial(open_sessions, runner, 1, first=4))
            expect(sessions).to_have_count(4)
            fourth = sessions.filter(has_text="acme/eu-4")
            expect(fourth.get_by_text("Open", exact=True)).to_be_visible()

            # A row opens the session: its record and what its child wrote.
            sessions.filter(has_text="acme/eu-1").click()
            detail = page.get_by_role("region", name="acme/eu-1 #1")
            expect(detail).to_be_visible()
            expect(detail).to_contain_text("heartbeat:main")
            expect(detail).to_contain_text("dash-1")
            expect(detail.get_by_label("Log tail")).to_contain_text("beat 1 of acme/eu-1 #1")
            detail.get_by_role("button", name="Close").click()
            expect(detail).to_be_hidden()

            # Its Dispose button stops a session, once confirmed; the row says how and why.
            disposed = sessions.filter(has_text="acme/eu-2")
            disposed.get_by_role("button", name="Dispose").click()
            confirm = page.get_by_role("dialog", name="Dispose acme/eu-2 #1?")
            confirm.get_by_role("button", name="Dispose").click()
            expect(disposed.get_by_text("Stopped", exact=True)).to_be_visible()
            expect(disposed.get_by_text("Disposed", exact=True)).to_be_visible()
            expect(disposed.get_by_text("exited (code 0)", exact=True)).to_be_visible()
            expect(disposed.get_by_role("button", name="Dispose")).to_be_hidden()
            for number in (1, 3):
                row = sessions.filter(has_text=f"acme/eu-{number}")
                expect(row.get_by_text("Loaded", exact=True)).to_be_visible()

            # The stopped session's record says why it stopped, and how its child ended.
            disposed.click()
            detail = page.get_by_role("region", name="acme/eu-2 #1")
            expect(detail.get_by_text("Disposed", exact=True)).to_be_visible()
            expect(detail).to_contain_text("exited (code 0)")
            expect(detail.get_by_label("Log tail")).to_contain_text("stopping after")
            page.screenshot(path=tmp_path / "dashboard.png", full_page=True)
            assert runner.operator_token not in page.content()
            assert runner.operator_token not in page.url
    assert (tmp_path / "dashboard.png").stat().st_size > 0


def test_the_tenants_usage_against_their_quotas_and_the_runners_against_its_capacity(
    tmp_path: Path,
) -> None:
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(TENANTS)
    tenants.chmod(0o600)
    flags = ("--runner-id", "dash-t", "--tenants", tenants, "--max-children", "8")
    with serving(tmp_path / "state", *flags) as runner:
        first = Key(identity="acme-web", instance="eu-1")
        trio.run(functools.partial(open_as, runner, ACME_TOKEN, first, load=True))
        with browsing(runner) as page:
            sign_in(page, runner)
            table = page.get_by_role("table", name="Tenants")
            expect(table.get_by_role("row")).to_have_count(3)  # the header and two tenants
            acme = table.get_by_role("row").filter(has_text="acme")
            cells = acme.get_by_role("cell")
            # Its name, its patterns, then sessions, children, memory and CPU against quota.
            expect(cells.nth(1)).to_have_text("acme, acme-*")
            expect(cells.nth(2)).to_have_text("1 / 2")
            expect(cells.nth(3)).to_have_text("1 / 2")
            expect(cells.nth(4)).to_have_text("512 MiB / 2 GiB")  # the tenant's default ceiling
            expect(cells.nth(5)).to_have_text(re.compile(r"^\d+% / no quota$"))
            for cell in (cells.nth(2), cells.nth(3)):  # half used: not marked
                expect(cell).not_to_have_class(re.compile(r"\b(near|full)\b"))
            globex = table.get_by_role("row").filter(has_text="globex").get_by_role("cell")
            expect(globex.nth(2)).to_have_text("0 / no quota")
            # The runner's children and memory against its capacity.
            here = page.get_by_role("table", name="Runners").get_by_role("row")
            here = here.filter(has_text="dash-t").get_by_role("cell")
            expect(here.nth(7)).to_have_text("1 / 8")
            expect(here.nth(8)).to_have_text(re.compile(r"^512 MiB / [\d.]+ [GT]iB$"))

            # A second session, heard as an event, takes the tenant's last session: marked.
            second = Key(identity="acme", instance="eu-2")
            trio.run(functools.partial(open_as, runner, ACME_TOKEN, second, load=False))
            expect(cells.nth(2)).to_have_text("2 / 2")
            expect(cells.nth(2)).to_have_class(re.compile(r"\bfull\b"))
            expect(cells.nth(3)).to_have_text("1 / 2")  # an Open session holds no child
            expect(page.locator("#tenants-count")).to_have_text("2 tenants · 1 at a quota")
