"""The dashboard (``GET /``), driven in a real headless Chromium (docs/service.md section B).

An operator opens the runner's page, signs in once with the operators' token, sees the
sessions live, opens one to read its record and its log tail, and disposes one with its
button. The browser is Debian's Chromium (``/usr/bin/chromium``), driven by Playwright's
sync API; Playwright never downloads a browser here, and a machine without Chromium
fails this test rather than skip it: the page is only known to work where it ran.

The page may reach nothing but the runner (no external assets), and logs no error.
"""

from __future__ import annotations

import functools
import shutil
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

from ..support import Runner, open_sessions, serving

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


def test_an_operator_signs_in_sees_the_sessions_reads_one_and_disposes_one(
    tmp_path: Path,
) -> None:
    executable = chromium()
    with serving(tmp_path / "state", "--runner-id", "dash-1") as runner:
        trio.run(functools.partial(open_sessions, runner, 3, loaded=3))
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
                expect(this_one.get_by_role("cell").last).to_have_text("3")
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
            finally:
                browser.close()
    assert not elsewhere, f"the page reached outside the runner: {elsewhere}"
    assert not errors, f"the page logged errors: {errors}"
    assert (tmp_path / "dashboard.png").stat().st_size > 0
