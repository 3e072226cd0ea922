"""The dashboard (``GET /``), driven in a real headless Chromium (docs/service.md section B).

An operator opens the runner's page, signs in once with the operators' token, sees the
sessions live, opens one to read its record and its log tail, and disposes one with its
button; on a runner with tenants (section D), each tenant's usage against its quota and
the runner's children and memory against its capacity; on a runner of a fleet (section
C, two ``serve`` processes on this module's PostgreSQL database), the sessions another
runner holds, with their times, and a link to that runner's dashboard where this page
would get a 421, and every termination in the words of ``Termination.describe()``.
The browser is Debian's Chromium (``/usr/bin/chromium``), driven by Playwright's sync
API; Playwright never downloads a browser here, and a machine without Chromium fails
this test rather than skip it: the page is only known to work where it ran.

The page may reach nothing but the runner (no external assets), and logs no error.
"""

from __future__ import annotations

import contextlib
import functools
import re
import shutil
import signal
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Final

import attrs
import httpx
import pytest
import trio
from playwright.sync_api import (
    ConsoleMessage,
    Page,
    Request,
    Response,
    ViewportSize,
    expect,
    sync_playwright,
)

from trio_supervisor import (
    ExitStatus,
    Fault,
    Handle,
    Key,
    Limits,
    Load,
    MemoryStore,
    OpenRecord,
    PostgresStore,
    Recovery,
    StoppedRecord,
    Termination,
)
from trio_supervisor.client import connect
from trio_supervisor.service.sign_in import REFUSED, SignIns
from trio_supervisor.service.tenants import token_hash
from trio_supervisor.stores._postgres_member import RUNNER_LOST
from trio_supervisor.testing import FakeExecution

from ..support.postgres import database_for
from ..support.runners import LEASE, Runner, open_sessions, serving
from ..support.service import HOSTS_TOKEN, OPERATOR_TOKEN, served
from ..support.sessions import supervise_embedded
from ..support.waits import settled

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


def sign_in(page: Page, runner: Runner, token: str | None = None) -> None:
    """Sign in to ``runner``'s page with ``token`` (its state directory's by default)."""
    page.goto(runner.url + "/")
    expect(page.get_by_role("heading", name="Sign in")).to_be_visible()
    page.get_by_label("Operator token").fill(token or runner.operator_token)
    page.get_by_role("button", name="Sign in").click()


@contextlib.contextmanager
def browsing(runner: Runner, *, tolerated: tuple[str, ...] = ()) -> Iterator[Page]:
    """A page in a headless Chromium, for ``runner``; on the way out, fails if the page
    reached anything but the runner or logged an error (each error names its URL; one
    that holds a ``tolerated`` text is expected)."""
    executable = chromium()
    elsewhere: list[str] = []
    errors: list[str] = []

    def requested(request: Request) -> None:
        if not request.url.startswith(runner.url + "/"):
            elsewhere.append(request.url)

    def logged(message: ConsoleMessage) -> None:
        if message.type == "error":
            text = f"{message.text} at {message.location.get('url', '?')}"
            if not any(expected in text for expected in tolerated):
                errors.append(text)

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
        # Drained at the end, the runner's /readyz answers 503, as a balancer must see.
        drained = f"status of 503 () at {runner.url}/readyz"
        with browsing(runner, tolerated=(drained,)) as page:
            page.goto(runner.url + "/")
            # The sign-in names no file of the runner's machine: the page is anyone's.
            region = page.get_by_role("region", name="Sign in")
            expect(region).to_contain_text("trio-supervisor dashboard")
            expect(region).not_to_contain_text(str(tmp_path))
            # An operator's sign-in link: its code is traded once, and leaves the address.
            link = runner.url + trio.run(sign_in_path, runner)
            page.goto(link)
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
            assert page.url == runner.url + "/"  # the code left the address bar

            # A key opened again: its row shows the newest generation; its panel lists
            # every retained one, and a click on one shows it.
            trio.run(open_again, runner, Key(identity="acme", instance="eu-2"))
            expect(disposed.get_by_text("Open", exact=True)).to_be_visible()
            expect(disposed.get_by_role("cell").nth(1)).to_have_text("2")
            expect(sessions).to_have_count(4)  # a row a key
            disposed.click()
            detail = page.get_by_role("region", name="acme/eu-2 #2")
            history = page.get_by_role("table", name="Generations").get_by_role("row")
            expect(history).to_have_count(2)
            expect(history.nth(0)).to_contain_text("#2Open")
            expect(history.nth(1)).to_contain_text("#1StoppedDisposedexited (code 0)")
            history.nth(1).click()
            detail = page.get_by_role("region", name="acme/eu-2 #1")
            expect(detail.get_by_label("Log tail")).to_contain_text("stopping after")
            expect(history.nth(1)).to_have_attribute("aria-current", "true")

            # Drained (it holds sessions still: it runs on), the runner says so.
            trio.run(drain, runner)
            expect(this_one.get_by_text("draining", exact=True)).to_be_visible(timeout=WAIT)
            expect(page.get_by_text("1 alive (1 draining) · 0 gone")).to_be_visible()
            expect(page.get_by_role("status")).to_contain_text("draining")
            expect(page.get_by_text("The runner is poisoned")).to_be_hidden()
    assert (tmp_path / "dashboard.png").stat().st_size > 0


async def sign_in_path(runner: Runner) -> str:
    """A sign-in link's path (``/?code=CODE``), as ``trio-supervisor dashboard`` gets it."""
    async with runner.operator() as operator:
        path: str = (await operator.dashboard_code())["path"]
        return path


async def open_again(runner: Runner, key: Key) -> None:
    """Open the next generation of ``key`` (its last one is generation 1)."""
    async with runner.host() as host:
        await host.open(key, f"open-{uuid.uuid4()}", expected_generation=1, lease=LEASE)


def test_a_sign_in_link_works_once_and_a_spent_one_says_so_on_the_sign_in(
    tmp_path: Path,
) -> None:
    with serving(tmp_path / "state") as runner:
        link = runner.url + trio.run(sign_in_path, runner)
        refused = f"status of 401 () at {runner.url}/v1/dashboard/sign-in"
        # The JSON page below has no icon of its own: the browser asks for the default one.
        no_icon = f"status of 404 () at {runner.url}/favicon.ico"
        with browsing(runner, tolerated=(refused, no_icon)) as page:
            page.goto(link)
            expect(page.get_by_role("button", name="Sign out")).to_be_visible()
            expect(page.get_by_role("heading", name="Sessions")).to_be_visible()
            # The same link again, in a fresh tab: the code is spent.
            # Off the dashboard first (to a page of the same origin that runs nothing):
            # storage cleared under the live page would refuse the calls it makes.
            page.goto(runner.url + "/healthz")
            page.evaluate("sessionStorage.clear()")
            page.goto(link)
            expect(page.get_by_role("heading", name="Sign in")).to_be_visible()
            expect(page.get_by_role("alert").filter(has_text="sign-in link")).to_have_text(
                "This sign-in link does not work: its code is wrong, was used already (each "
                "works once) or expired; ask an operator for a new link (trio-supervisor "
                "dashboard), or paste the operators' token."
            )
            # A wrong code, the same words; and the token still signs in.
            page.goto(runner.url + "/?code=not-a-code")
            expect(page.get_by_role("alert").filter(has_text="sign-in link")).to_be_visible()
            sign_in(page, runner)
            expect(page.get_by_role("button", name="Sign out")).to_be_visible()


async def test_a_code_is_spent_once_and_expires_by_the_runners_clock(fake: FakeExecution) -> None:
    now = [1000.0]
    sign_ins = SignIns(code_for=300.0, session_for=3600.0, clock=lambda: now[0])
    async with (
        supervise_embedded(MemoryStore(), fake) as supervisor,
        served(supervisor, sign_ins=sign_ins) as host,
    ):
        url = str(host._client.base_url)
        async with (
            httpx.AsyncClient(base_url=url) as anyone,
            httpx.AsyncClient(base_url=url, headers=bearer(OPERATOR_TOKEN)) as operators,
            httpx.AsyncClient(base_url=url, headers=bearer(HOSTS_TOKEN)) as hosts,
        ):

            async def mint() -> str:
                answer = await operators.post("/v1/dashboard/codes")
                assert answer.status_code == 200, answer.text
                assert answer.json()["expires_in"] == 300.0
                assert answer.json()["path"] == "/?code=" + answer.json()["code"]
                code: str = answer.json()["code"]
                return code

            async def trade(code: str) -> httpx.Response:
                return await anyone.post("/v1/dashboard/sign-in", json={"code": code})

            # Only operators mint codes.
            assert (await hosts.post("/v1/dashboard/codes")).status_code == 403
            assert (await anyone.post("/v1/dashboard/codes")).status_code == 401
            # Once: the second trade of a code is refused, as a wrong code is.
            code = await mint()
            first = await trade(code)
            assert first.status_code == 200, first.text
            assert first.json()["expires_in"] == 3600.0
            for refused in (await trade(code), await trade("wrong")):
                assert (refused.status_code, refused.json()["code"]) == (401, "Unauthorized")
                assert refused.json()["detail"] == REFUSED
            # The sign-in is the operators' token, until it expires.
            signed_in = bearer(first.json()["token"])
            listed = await anyone.get("/v1/runners", headers=signed_in)
            assert listed.status_code == 200, listed.text
            now[0] += 3600.0
            assert (await anyone.get("/v1/runners", headers=signed_in)).status_code == 401
            # A code expires: usable just before its end, not at it.
            early, late = await mint(), await mint()
            now[0] += 299.9
            assert (await trade(early)).status_code == 200
            now[0] += 0.1
            assert (await trade(late)).status_code == 401
            # A body that is no code is a 422, not a stack trace.
            empty = await anyone.post("/v1/dashboard/sign-in", json={"code": ""})
            assert (empty.status_code, empty.json()["code"]) == (422, "InvalidRequest")


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


async def drain(runner: Runner) -> None:
    async with runner.operator() as operator:
        await operator.drain(3600)


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
            # CPU: a sum of ceilings, and why it reads high (acme asked for no CPU limit).
            expect(cells.nth(5)).to_have_text(
                re.compile(r"^\d+% / no quota1 child without a limit counts as \d+ cores?$")
            )
            expect(page.get_by_role("columnheader", name="CPU ceilings")).to_be_visible()
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


# -- a fleet of two: the page of a runner that does not hold every session -----------------

FLEET_HOSTS: Final = "fleet-hosts-token-for-the-dashboard"
FLEET_OPERATORS: Final = "fleet-operators-token-for-the-dashboard"
ON_A: Final = Key(identity="acme", instance="on-a")
ON_B: Final = Key(identity="acme", instance="on-b")
SIGNAL_NONE: Final = 200  # a number no signal has
PROBLEMS: Final = (Fault(type="OSError", message="gone"), Fault(type="ValueError", message="x"))
# One of each way Termination.describe() words an ending (each of its branches), as the
# records of a runner of the fleet that is gone ("dash-gone") hold them.
TERMINATIONS: Final = {
    "no-child": Termination(kind="none", exit=ExitStatus()),
    "no-child-with-problems": Termination(kind="none", exit=ExitStatus(), cause=PROBLEMS[:1]),
    "exit-code": Termination(kind="exited", exit=ExitStatus(code=3)),
    "signal": Termination(kind="exited", exit=ExitStatus(signal=signal.SIGTERM)),
    "unnamed-signal": Termination(kind="killed", exit=ExitStatus(signal=SIGNAL_NONE)),
    "killed-with-descendants": Termination(
        kind="killed", exit=ExitStatus(signal=signal.SIGKILL, descendants_killed=2)
    ),
    "out-of-memory": Termination(
        kind="killed", exit=ExitStatus(signal=signal.SIGKILL, oom_limit=256 << 20)
    ),
    "cancelled": Termination(kind="exited", exit=ExitStatus(cancelled=True)),
    "cancelled-late": Termination(kind="killed", exit=ExitStatus(cancelled=True)),
    "already-gone": Termination(kind="exited", exit=ExitStatus()),
    "runner-lost": RUNNER_LOST,
    "one-descendant-two-problems": Termination(
        kind="exited", exit=ExitStatus(code=0, descendants_killed=1), cause=PROBLEMS
    ),
}


@attrs.frozen
class Fleet:
    """Runners ``dash-a`` and ``dash-b`` of one fleet, and the operators' token file each
    was given (a path of the test's, not a state directory's)."""

    a: Runner
    b: Runner
    operator_token_file: Path


def ended(name: str, termination: Termination) -> StoppedRecord:
    """The Stopped record of session ``acme-ended/NAME`` #1, which ended so."""
    handle = Handle(
        key=Key(identity="acme-ended", instance=name), token=str(uuid.uuid4()), generation=1
    )
    opened = OpenRecord(handle=handle, request_id=f"open-{name}", lease=LEASE, limits=Limits())
    return StoppedRecord.of(opened, Recovery(), termination)


async def held_sessions(store: str, a: Runner, b: Runner) -> None:
    """A session held by each runner (a's loaded, so that it has a log), and the ended
    sessions of TERMINATIONS, left by a runner that is gone."""
    async with PostgresStore(store, runner_id="dash-gone") as gone:
        await gone.save_many([ended(name, one) for name, one in TERMINATIONS.items()])
    async with connect(b.url, token=FLEET_HOSTS) as on_b:
        await on_b.open(ON_B, "open-on-b", lease=LEASE)
    async with connect(a.url, token=FLEET_HOSTS) as on_a:
        record = await on_a.open(ON_A, "open-on-a", lease=LEASE)
        await on_a.load(record.handle, Load(specifier="heartbeat:main"))


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """Two ``serve`` processes on this module's database, their tokens in files of the
    test's (``--token-file``, ``--operator-token-file``), each renewing its row every
    second; b's session's times already published once the fixture yields."""
    root = tmp_path_factory.mktemp("fleet")
    hosts, operators = root / "hosts-token", root / "operators" / "fleet-operator-token"
    operators.parent.mkdir(mode=0o700)
    for path, token in ((hosts, FLEET_HOSTS), (operators, FLEET_OPERATORS)):
        path.write_text(token + "\n")
        path.chmod(0o600)
    with database_for(__name__) as store, contextlib.ExitStack() as stack:
        a, b = (
            stack.enter_context(
                serving(
                    root / name,
                    *("--store", store, "--runner-id", f"dash-{name}", "--runner-lease", "3"),
                    *("--token-file", hosts, "--operator-token-file", operators),
                    *("--no-standby", "--no-fork-server"),
                )
            )
            for name in ("a", "b")
        )
        trio.run(held_sessions, store, a, b)

        def published() -> bool:
            listed = trio.run(functools.partial(a.sessions_as, FLEET_OPERATORS))
            return any(one["runner"] == "dash-b" and one["age"] is not None for one in listed)

        assert settled(published, 10.0, every=0.2), "b's session's times were not published"
        yield Fleet(a, b, operators)


def test_a_session_held_by_another_runner_shows_its_times_links_there_and_nothing_answers_421(
    fleet: Fleet,
) -> None:
    a, b = fleet.a, fleet.b
    with browsing(a) as page:
        answers: list[Response] = []
        page.on("response", lambda response: answers.append(response))
        page.goto(a.url + "/")
        # The sign-in names no file, not even the operators' token file it was given.
        region = page.get_by_role("region", name="Sign in")
        expect(region).to_be_visible()
        expect(region).not_to_contain_text(str(fleet.operator_token_file.parent))
        sign_in(page, a, FLEET_OPERATORS)

        # b's session, listed on a: its age and lease left, as b published them; no
        # Dispose button (only b disposes it) but a link to b's dashboard.
        held = page.locator(f'tr[data-session="{ON_B.identity}/{ON_B.instance}#1"]')
        expect(held.get_by_text("dash-b", exact=True)).to_be_visible()
        expect(held.locator("td.age")).to_have_text(re.compile(r"^\d"))
        expect(held.locator("td.lease")).to_have_text(re.compile(r"^\d"))
        expect(held.get_by_role("button", name="Dispose")).to_be_hidden()
        expect(held.get_by_role("link", name="held by dash-b")).to_have_attribute(
            "href", b.url + "/"
        )
        # Its panel says who holds it and links there, and reads no log of a.
        held.click()
        detail = page.get_by_role("region", name="acme/on-b #1")
        expect(detail.locator("#detail-elsewhere")).to_have_text(
            "Held by runner dash-b: its log and its Dispose button are on its dashboard."
        )
        expect(detail.get_by_role("link", name="its dashboard")).to_have_attribute(
            "href", b.url + "/"
        )
        expect(detail.get_by_label("Log tail")).to_be_hidden()
        expect(detail.get_by_role("button", name="Dispose")).to_be_hidden()
        expect(detail).to_contain_text(re.compile(r"Lease left\s*\d"))

        # a's own session: no note, its log tail and its Dispose button, as before.
        own = page.locator(f'tr[data-session="{ON_A.identity}/{ON_A.instance}#1"]')
        expect(own.get_by_role("button", name="Dispose")).to_be_visible()
        own.click()
        detail = page.get_by_role("region", name="acme/on-a #1")
        expect(detail.get_by_label("Log tail")).to_contain_text("beat 1 of acme/on-a #1")
        expect(detail.locator("#detail-elsewhere")).to_be_hidden()
        # The runners: a, by its id, is this one.
        here = page.get_by_role("table", name="Runners").locator("tr.here")
        expect(here).to_have_count(1)
        expect(here.get_by_role("cell").first).to_have_text("dash-a")

    misdirected = [(one.status, one.url) for one in answers if one.status == 421]
    assert not misdirected, misdirected
    asked = [one.url for one in answers if "/v1/logs" in one.url]
    assert asked, "the page read no log at all"
    assert all(f"instance={ON_A.instance}" in url for url in asked), asked


def test_every_termination_reads_as_the_model_describes_it(fleet: Fleet) -> None:
    with browsing(fleet.a) as page:
        sign_in(page, fleet.a, FLEET_OPERATORS)
        for name, termination in TERMINATIONS.items():
            row = page.locator(f'tr[data-session="acme-ended/{name}#1"]')
            expect(row.locator("td.termination-cell")).to_have_text(termination.describe())
        # The panel of a session a dead runner held and the fleet took over.
        page.locator('tr[data-session="acme-ended/runner-lost#1"]').click()
        detail = page.get_by_role("region", name="acme-ended/runner-lost #1")
        expect(
            detail.get_by_text("exited (runner lost; exit status unknown)", exact=True)
        ).to_be_visible()
        expect(detail.locator("#detail-elsewhere")).to_have_text(
            "Held by runner dash-gone, which is gone: its log stayed on its machine."
        )
