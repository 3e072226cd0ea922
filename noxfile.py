"""Sessions: tests, lint, typecheck, build, examples, conformance, fleet, availability, chaos,
api, mutants, mutants-adapters, bench, bench-hundred, bench-check, docs."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import nox

nox.options.sessions = ["tests", "lint", "typecheck"]
# Reuse a session's environment when it exists: every session installs the project in
# editable mode, so a reused one sees the current code and pip only checks the pins.
# CI starts from a fresh clone (and .ci/run removes .nox), so it always builds afresh.
nox.options.reuse_venv = "yes"
nox.options.error_on_missing_interpreters = True


class _NoUvNotice(logging.Filter):
    """nox looks for uv on every virtualenv it makes and says so when it is absent; the
    sessions use pip, so that line is only noise to someone running the tests."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != "uv binary not found."


logging.getLogger("nox").addFilter(_NoUvNotice())


# What the tests need from the machine, beyond Python: Debian's package for each command.
# The dashboard's test drives a real headless chromium (never a downloaded browser), the
# TLS test makes its certificate with openssl, and the fleet's tests put PgBouncer in front
# of clusters of their own (tests/support/clusters.py; Debian's is /usr/sbin/pgbouncer).
MACHINE_NEEDS = {"chromium": "chromium", "openssl": "openssl", "pgbouncer": "pgbouncer"}


def install_machine_needs(session: nox.Session) -> None:
    """Install the Debian packages the tests need, or stop at once naming them."""
    missing = sorted(
        package for command, package in MACHINE_NEEDS.items() if not shutil.which(command)
    )
    if not missing:
        return
    if shutil.which("apt-get") and os.geteuid() == 0:
        session.log(
            f"installing {' and '.join(missing)} with apt-get: the tests need "
            f"{'them' if len(missing) > 1 else 'it'} (chromium is some 100 MB, a minute or "
            "more; apt's own output is shown only if it fails)"
        )
        # Silent: apt's progress is long; nox prints it all if a step fails.
        session.run("apt-get", "update", "-qq", external=True, silent=True)
        session.run(
            "apt-get",
            "install",
            "-y",
            "-qq",
            *missing,
            env={"DEBIAN_FRONTEND": "noninteractive"},
            external=True,
            silent=True,
        )
        return
    session.error(
        f"the tests need {' and '.join(missing)}, which this machine lacks: install "
        f"{'them' if len(missing) > 1 else 'it'} (on Debian or Ubuntu: "
        f"sudo apt-get install {' '.join(missing)}), then run this again"
    )


@nox.session
def tests(session: nox.Session) -> None:
    """Run the test suite (installing what it needs from the machine's packages), on two
    worker processes more than the machine has cores: most tests wait on child processes,
    servers, clusters and disks rather than compute. A module's tests (a class's, for
    classes) stay on one worker, in order, the slowest folders first (pyproject's
    ``testpaths``). ``-- -n 0`` runs them all in this process.

    Measured on 2 cores, quiet, 1,320 tests: 3 workers 312 s, 4 workers 280 s."""
    install_machine_needs(session)
    session.install("-e", ".[test]")  # the test extra pulls [service,client]
    workers = str((os.cpu_count() or 1) + 2)
    session.run("python", "-m", "pytest", "-n", workers, "--dist", "loadscope", *session.posargs)


@nox.session
def build(session: nox.Session) -> None:
    """Build the wheel into dist/, then install it (with the service extra) in this
    session's fresh environment and run it from there, away from the source tree."""
    session.run("python", "-m", "pip", "wheel", "--no-deps", "-w", "dist", ".", silent=True)
    wheels = sorted(
        Path("dist").glob("trio_supervisor-*.whl"), key=lambda path: path.stat().st_mtime
    )
    if not wheels:
        session.error("pip made no wheel in dist/")
    wheel = wheels[-1].resolve()
    session.install(f"{wheel}[service,client]")
    with session.chdir(session.create_tmp()):  # not the clone: the installed package
        session.run("trio-supervisor", "--version")
        session.run("trio-supervisor", "serve", "--help", silent=True)
        session.run(
            "python",
            "-c",
            "import trio_supervisor, trio_supervisor.client, trio_supervisor.service; "
            "assert 'site-packages' in trio_supervisor.__file__, trio_supervisor.__file__; "
            "print('installed from the wheel:', trio_supervisor.__file__)",
        )
    session.log(f"built and tried {wheel.name}: pip install {wheel}")


@nox.session
def lint(session: nox.Session) -> None:
    """Ruff: lint (with the ASYNC rules) and formatting."""
    session.install("ruff")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
def typecheck(session: nox.Session) -> None:
    """mypy --strict over the package, the tests and the examples."""
    session.install("-e", ".[lint]")
    session.run("mypy")


@nox.session
def examples(session: nox.Session) -> None:
    """Run the example runner (real child processes on a SQLite store), then a remote host
    against a runner service of its own (``examples/remote_host.py --serve``)."""
    session.install("-e", ".[service]")  # remote_host.py starts a runner and reaches it
    session.run("python", "examples/runner.py", *session.posargs)
    if "--hold" not in session.posargs:
        session.run("python", "examples/remote_host.py", "--serve")


@nox.session
def conformance(session: nox.Session) -> None:
    """The conformance machines with the deep Hypothesis profile (>= 20,000 examples)."""
    session.install("-e", ".[test]")
    session.env["TRIO_SUPERVISOR_CONFORMANCE"] = "deep"
    session.env["PYTEST_TIMEOUT"] = "0"  # pytest-timeout off: each machine runs for minutes
    session.run("python", "-m", "pytest", "tests/conformance/test_conformance.py", *session.posargs)


@nox.session
def fleet(session: nox.Session) -> None:
    """The fleet machine at length (200 examples on PostgreSQL: about half an hour), and
    the conformance machine on PostgresStore (2,000 examples)."""
    session.install("-e", ".[test]")
    session.env["TRIO_SUPERVISOR_FLEET_EXAMPLES"] = "200"
    session.env["TRIO_SUPERVISOR_CONFORMANCE"] = "deep"
    session.env["TRIO_SUPERVISOR_POSTGRES_EXAMPLES"] = "2000"
    session.env["PYTEST_TIMEOUT"] = "0"  # each machine runs for many minutes
    session.run(
        "python",
        "-m",
        "pytest",
        "tests/conformance/test_fleet_machine.py",
        "tests/conformance/test_conformance_postgres.py",
        *session.posargs,
    )


@nox.session
def api(session: nox.Session) -> None:
    """Fuzz a live runner from its own OpenAPI document (schemathesis, >= 1,000 examples)."""
    session.install("-e", ".[test]")
    # Per operation: 9 of the 12 take input (the other 3 run a few times): 200 is ~1,800.
    session.env["TRIO_SUPERVISOR_API_EXAMPLES"] = "200"
    session.run("python", "-m", "pytest", "tests/service/test_api_fuzz.py", *session.posargs)


@nox.session
def chaos(session: nox.Session) -> None:
    """The fleet's chaos test at length: three runners killed, frozen and drained, and
    their database restarted, stopped past their trust and failed over, at random for 7
    minutes while hosts work (``TRIO_SUPERVISOR_CHAOS_SECONDS``; the suite
    runs it for 10 s). ``TRIO_SUPERVISOR_CHAOS_SEED`` replays a run's choices."""
    session.install("-e", ".[test]")
    seconds = os.environ.get("TRIO_SUPERVISOR_CHAOS_SECONDS", "420")
    session.env["TRIO_SUPERVISOR_CHAOS_SECONDS"] = seconds
    session.env["PYTEST_TIMEOUT"] = "0"
    session.run(
        "python",
        "-m",
        "pytest",
        "tests/service/test_fleet_processes.py",
        "-k",
        "chaos",
        "-s",
        *session.posargs,
    )


@nox.session
def availability(session: nox.Session) -> None:
    """The fleet through its database at length (docs/design.md B1-B7): the suite's
    restarts, outages, failovers, PgBouncer and full-disk tests, with the outage under
    ``--runner-lease 60`` as long as a Patroni failover with its defaults (35 s; the
    suite stops its server for 5 s) and every failover's variant (the suite runs three
    of six), then the chaos test with the database's restarts,
    outages and failover for 3 minutes."""
    session.install("-e", ".[test]")
    session.env["TRIO_SUPERVISOR_OUTAGE_SECONDS"] = "35"
    session.env["TRIO_SUPERVISOR_AVAILABILITY"] = "full"  # every failover's variant
    session.run(
        "python",
        "-m",
        "pytest",
        "tests/service/test_fleet_availability.py",
        "tests/service/test_fleet_failover.py",
        "tests/service/test_store_availability.py",
        *session.posargs,
    )
    session.env["TRIO_SUPERVISOR_CHAOS_SECONDS"] = "180"
    session.env["PYTEST_TIMEOUT"] = "0"
    session.run(
        "python", "-m", "pytest", "tests/service/test_fleet_processes.py", "-k", "chaos", "-s"
    )


@nox.session
def mutants(session: nox.Session) -> None:
    """Mutation testing of the engine, trio_supervisor/_core/ (mutmut); prints the
    survivors. Scope and tests: pyproject.toml's [tool.mutmut]. Two workers, as on a
    machine of 2 cores.

    The conformance machine runs its quick profile here: each mutant no faster test
    kills runs it. ``mutants/`` keeps the results: a second run tries only what changed.
    Measured on a fresh clone, 2 cores shared with other work (load average 4-8): 25 min
    wall in all (the environment, the stats, then 1,565 mutants at 1.1 a second).
    """
    session.install("-e", ".[test]", "mutmut==3.8.1")
    # A mutant that deadlocks a test (under MockClock's autojump it waits using no CPU)
    # fails it after 5 s (pytest-timeout; the slowest of these tests takes 2 s under
    # mutmut on a busy machine), and counts as killed, instead of holding a worker until
    # mutmut's own bound: most of the run's time went to such mutants before.
    session.env["PYTEST_TIMEOUT"] = "5"
    session.env["TRIO_SUPERVISOR_CONFORMANCE"] = "quick"
    session.run("mutmut", "run", "--max-children", "2", *session.posargs)
    session.run("mutmut", "results")


# mutmut reads its settings from one table, [tool.mutmut] of the pyproject.toml where it
# runs, and keeps its mutants and results in that directory's mutants/. The adapters'
# run is made in a directory of its own, whose pyproject.toml is the project's with the
# two tables' names swapped, and whose package and tests are links to the project's:
# each run keeps results of its own (a change to one's tests would reset the other's).
MUTANTS_ADAPTERS = Path("mutants-adapters")
_MUTMUT_TABLES = ("\n[tool.mutmut]\n", "\n[tool.mutmut-adapters]\n")


@nox.session(name="mutants-adapters")
def mutants_adapters(session: nox.Session) -> None:
    """Mutation testing past the engine (mutmut): the stores (memory, SQLite and
    PostgreSQL, with their modules), the service's admission and tenants; prints the
    survivors. Scope and tests: pyproject.toml's [tool.mutmut-adapters]. Run in
    mutants-adapters/ (its mutants/ keeps the results: a second run tries only what
    changed), six mutants at a time. The tests need PostgreSQL
    (tests/support/postgres.py), as the suite's do.
    """
    session.install("-e", ".[test,lint]", "mutmut==3.8.1")  # lint: mypy, the type check
    project = Path("pyproject.toml").read_text()
    core, adapters = _MUTMUT_TABLES
    if project.count(core) != 1 or project.count(adapters) != 1:
        session.error("pyproject.toml needs one [tool.mutmut] and one [tool.mutmut-adapters]")
    MUTANTS_ADAPTERS.mkdir(exist_ok=True)
    for name in ("trio_supervisor", "tests"):
        link = MUTANTS_ADAPTERS / name
        if not link.is_symlink():
            link.symlink_to(Path("..") / name)
    swapped = project.replace(core, "\n[tool.mutmut-core]\n").replace(adapters, core)
    (MUTANTS_ADAPTERS / "pyproject.toml").write_text(swapped)
    # The stores' slowest tests take 9 s (a network that stops answering), more on a busy
    # machine: a mutant that deadlocks one is ended after 20.
    session.env["PYTEST_TIMEOUT"] = "20"
    # Each mutant's module takes a kept database instead of making and dropping one
    # (tests/support/postgres.py): dropping one checkpoints the whole server.
    session.env["TRIO_SUPERVISOR_TEST_DATABASES"] = str((MUTANTS_ADAPTERS / ".databases").resolve())
    with session.chdir(MUTANTS_ADAPTERS):
        try:
            # Six at a time on 2 cores: a mutant's tests spend most of their time
            # waiting (on PostgreSQL, and on the fleet's real bounds of seconds). With
            # three the load average stayed near 1 (and the store's runtime went 24
            # mutants a minute), with six near 1.5 (52 a minute, in other functions of
            # the same modules). `-- --max-children N` changes it.
            session.run("mutmut", "run", "--max-children", "6", *session.posargs)
        finally:
            # What a mutant's tests left: kept databases, and the bouncers and clusters
            # of tests ended by a timeout (os._exit: no teardown ran).
            session.run("python", "-c", "from tests.support.postgres import drop_kept; drop_kept()")
            session.run(
                "python", "-c", "from tests.support.clusters import stop_orphans; stop_orphans()"
            )
        session.run("mutmut", "results")


@nox.session
def bench(session: nox.Session) -> None:
    """The side-by-side benchmarks; pass ``-- --json out.json`` to keep the figures."""
    session.install("-e", ".[service,postgres]")  # service.py serves a runner; fleet, dbcost
    session.run("python", "-m", "benchmarks", *session.posargs)


@nox.session(name="bench-hundred")
def bench_hundred(session: nox.Session) -> None:
    """A hundred runners of 10,000 sessions each on one PostgreSQL cluster of its own, with
    pgbench's TPC-B-like rate beside them (benchmarks/hundred.py, the group ``hundred``,
    which a run without ``--only`` leaves out): about ten minutes and a million rows.
    ``-- --json out.json`` keeps the tables; ``-- --quick`` is a smoke test (5 runners of
    100 sessions, half a minute)."""
    # As the session bench, and pytest: the cluster is tests/support/clusters.py's.
    session.install("-e", ".[test]")  # the test extra pulls [service,client,postgres]
    session.run("python", "-m", "benchmarks", "--only", "hundred", *session.posargs)


@nox.session(name="bench-check")
def bench_check(session: nox.Session) -> None:
    """The benchmarks' regression guard, in two minutes at most: a fast subset compared
    with the references in docs/benchmarks.md; fails on a drop beyond the noise band.
    ``-- --record 5`` measures the references and bands again (not part of .ci/run)."""
    session.install("-e", ".[service,postgres]")  # as the session bench
    session.run("python", "-m", "benchmarks.check", *session.posargs)


@nox.session
def docs(session: nox.Session) -> None:
    """Build the documentation site into docs/_build/html (open its index.html), with
    every warning an error and every cross-reference resolved (``-W -n``). Offline: no
    inventory is fetched. autodoc imports the whole package, so the docs extra pulls the
    service, client and postgres extras. Measured on 2 cores, shared: about 15 s of
    build, plus the environment the first time."""
    session.install("-e", ".[docs]")
    session.run(
        "python",
        "-m",
        "sphinx",
        "-W",
        "--keep-going",
        "-n",
        "-b",
        "html",
        "docs",
        "docs/_build/html",
        *session.posargs,
    )
    session.log(f"the site: {Path('docs/_build/html/index.html').resolve()}")
