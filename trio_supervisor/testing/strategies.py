"""Hypothesis strategies for the values of trio_supervisor (needs ``hypothesis``)."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

from ..model import (
    JSON,
    ActiveRecord,
    ChildIdentity,
    CodeIdentity,
    Disposed,
    Exited,
    ExitStatus,
    Expired,
    Fault,
    Handle,
    Key,
    Limits,
    Load,
    LoadedRecord,
    LoadFailed,
    LoadingRecord,
    OpenRecord,
    Recovery,
    SessionRecord,
    Shutdown,
    StoppedRecord,
    StoppingRecord,
    StopReason,
    Superseded,
    Termination,
)

__all__ = [
    "active_records",
    "handles",
    "json_values",
    "keys",
    "limits",
    "loads",
    "records",
    "stop_reasons",
    "terminations",
]

text = st.text(min_size=1, max_size=20)
optional_text = st.none() | st.text(max_size=20)
small_ints = st.none() | st.integers(min_value=-(2**31), max_value=2**31)
limit_values = st.none() | st.integers(min_value=0, max_value=2**62)

keys = st.builds(Key, identity=text, instance=text)
handles = st.builds(
    Handle,
    key=keys,
    token=st.uuids().map(str),
    generation=st.integers(min_value=1, max_value=2**53),
)
limits = st.builds(
    Limits,
    memory_bytes=limit_values,
    cpu_seconds=st.none() | st.integers(min_value=1, max_value=2**62),
    open_files=limit_values,
    file_size_bytes=limit_values,
    output_bytes=limit_values,
    processes=st.none() | st.integers(min_value=1, max_value=2**62),
    cpu_percent=st.none() | st.integers(min_value=1, max_value=2**62),
)
json_values: st.SearchStrategy[JSON] = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**53), max_value=2**53)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=10),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=8,
)
loads = st.builds(
    Load, specifier=text, config=st.dictionaries(st.text(max_size=5), json_values, max_size=3)
)
codes = st.builds(
    CodeIdentity, specifier=text, origin=optional_text, digest=optional_text, version=optional_text
)
children = st.builds(
    ChildIdentity,
    adapter=text,
    ref=text,
    pid=small_ints,
    pgid=small_ints,
    start_time=st.none() | st.integers(min_value=0, max_value=2**62),
    boot_id=optional_text,
    cgroup=optional_text,
)
faults = st.builds(Fault, type=text, message=st.text(max_size=30))
stop_reasons: st.SearchStrategy[StopReason] = st.one_of(
    st.sampled_from([Expired(), Disposed(), Exited(), Superseded(), Shutdown(), Recovery()]),
    st.builds(LoadFailed, cause=st.lists(faults, max_size=2).map(tuple)),
)
terminations = st.builds(
    Termination,
    kind=st.sampled_from(["exited", "killed"]),
    exit=st.builds(
        ExitStatus,
        code=small_ints,
        signal=small_ints,
        oom_limit=st.none() | st.integers(min_value=0, max_value=2**62),
    ),
    cause=st.lists(faults, max_size=2).map(tuple),
)
leases = st.floats(min_value=1e-3, max_value=1e6)


def _common(handle: Handle) -> dict[str, Any]:
    return {"handle": handle}


@st.composite
def active_records(draw: st.DrawFn, handle: Handle | None = None) -> ActiveRecord:
    """An Open, Loading or Loaded record."""
    fields: dict[str, Any] = {
        "handle": handle if handle is not None else draw(handles),
        "request_id": draw(text),
        "lease": draw(leases),
        "limits": draw(limits),
    }
    phase = draw(st.sampled_from(["open", "loading", "loaded"]))
    if phase == "open":
        return OpenRecord(**fields)
    if phase == "loading":
        return LoadingRecord(load=draw(loads), child=draw(st.none() | children), **fields)
    return LoadedRecord(load=draw(loads), code=draw(codes), child=draw(children), **fields)


@st.composite
def records(draw: st.DrawFn) -> SessionRecord:
    """A record of any phase."""
    previous = draw(active_records())
    phase = draw(st.sampled_from(["active", "stopping", "stopped"]))
    if phase == "active":
        return previous
    if phase == "stopping":
        return StoppingRecord.of(previous, draw(stop_reasons))
    return StoppedRecord.of(previous, draw(stop_reasons), draw(terminations))
