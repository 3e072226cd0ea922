"""The metrics and log fields page's tables (docs/reference/metrics-and-logs.md), made
from the code.

The metrics: a runner's registry (``service/metrics.py``'s ``Metrics``) with every source
of series in it, scraped once: each family's name, type, labels and help are what
``GET /metrics`` prints. The log fields: ``serve --log-format json``'s formatter run on a
record that carries every field of ``trio_supervisor.model.LOG_FIELDS``; each field's
meaning is written here, and a field of the formatter without one (or one here the
formatter no longer prints) fails the build.
"""

from __future__ import annotations

import json
import logging
import sys
from typing import Any

from prometheus_client.metrics import MetricWrapperBase

from trio_supervisor.cli import _serve
from trio_supervisor.model import LOG_FIELDS
from trio_supervisor.service import metrics as metrics_module


class _NoSupervisor:
    """What the scrape-time gauges read from a supervisor: nothing, and not poisoned."""

    poisoned = None

    def records(self) -> list[Any]:
        return []


def _registry() -> Any:
    """A runner's registry with every collector a runner registers (a fleet's too)."""
    metrics = metrics_module.Metrics()
    metrics.watch_tenants(lambda: [("tenant", {"sessions": 1}, {"sessions": 0})])
    metrics.watch_lost_writes(lambda: 0)
    metrics.registry.register(metrics_module._Snapshot(_NoSupervisor()))
    labels: dict[str, tuple[str, ...]] = {}
    for value in vars(metrics).values():
        if isinstance(value, MetricWrapperBase):
            # A labelled family prints no labels until it has a child: ask the family.
            labels[value._name] = value._labelnames
    return metrics.registry, labels


_EXPOSED = {"counter": "_total", "histogram": "_bucket, _sum, _count", "gauge": ""}
_ONLY_IN_A_FLEET = {f"{metrics_module.PREFIX}_store_lost_writes"}


def metrics() -> str:
    """A table of every metric family a runner's ``GET /metrics`` prints."""
    registry, labelled = _registry()
    rows = ["| Metric | Type | Labels | Meaning |", "|---|---|---|---|"]
    for family in registry.collect():
        labels = set(labelled.get(family.name, ()))
        for sample in family.samples:
            labels |= set(sample.labels) - {"le"}
        suffix = _EXPOSED.get(family.type, "")
        name = f"`{family.name}{suffix}`" if suffix.startswith("_t") else f"`{family.name}`"
        if suffix and not suffix.startswith("_t"):
            name += f" ({suffix})"
        meaning = " ".join(family.documentation.split())
        if family.name in _ONLY_IN_A_FLEET:
            meaning += " A fleet's runner only."
        shown = ", ".join(f"`{label}`" for label in sorted(labels)) or "—"
        rows.append(f"| {name} | {family.type} | {shown} | {meaning} |")
    return "\n".join(rows)


# What each field of a JSON log line means. The formatter's own fields first, then
# LOG_FIELDS; the build fails when this and the formatter's fields differ.
_LOG_MEANINGS = {
    "time": "When the line was logged, in the runner's local time (`asctime`).",
    "level": "`debug`, `info`, `warning`, `error` or `critical`.",
    "logger": "The logger's name, such as `trio_supervisor.supervisor`.",
    "message": "The line, in words.",
    "identity": "The session's key identity (a line about a session).",
    "instance": "The session's key instance.",
    "generation": "The session's generation.",
    "pid": "The child an earlier run left, found by recovery (no key is known there).",
    "pgid": "That child's process group, which recovery killed.",
    "descendants_killed": "How many processes of that group recovery killed besides it.",
    "containment": "At start: how the subprocess execution keeps a child's tree together.",
    "cgroups": "At start: the cgroup hierarchy that limits children's trees: `v2`, `v1` or `none`.",
    "isolation": "At start: how children are isolated from the runner.",
    "tenant": "A refused call's tenant (`operators` for the operators' token, \"\" for none).",
    "status": "The HTTP status a refused call was answered with.",
    "error": "The traceback, when the line logs an exception.",
}


def _formatted_fields() -> list[str]:
    """The fields of a JSON log line carrying every field, in the order printed."""
    try:
        raise RuntimeError("a failure")
    except RuntimeError:
        exc_info = sys.exc_info()
    record = logging.LogRecord("trio_supervisor", logging.INFO, __file__, 1, "m", (), exc_info)
    for name in LOG_FIELDS:
        setattr(record, name, 1)
    return list(json.loads(_serve._JsonFormatter().format(record)))


def log_fields() -> str:
    """A table of every field of ``serve --log-format json``'s lines."""
    printed = _formatted_fields()
    assert set(printed) == set(_LOG_MEANINGS), (
        "log fields without a meaning on the page, or gone from the code: "
        f"{sorted(set(printed) ^ set(_LOG_MEANINGS))}"
    )
    rows = ["| Field | Meaning |", "|---|---|"]
    for name in printed:
        origin = "" if name in LOG_FIELDS else " Every line has it." * (name != "error")
        rows.append(f"| `{name}` | {_LOG_MEANINGS[name]}{origin} |")
    return "\n".join(rows)
