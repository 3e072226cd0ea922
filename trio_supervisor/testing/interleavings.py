"""Explaining a concurrent burst: some interleaving of atomic steps must give what happened.

When the machine starts several operations at once, the supervisor may run them in any
order its awaits allow; the model cannot say which. So each operation is planned as a
short sequence of atomic model steps (:class:`Planned`), split where the design lets
other operations in:

* an open checks the health (O1), then takes the key's lock to check the request and
  the generation and to supersede (O3-O5), then checks again and saves (O6-O8), still
  holding the lock: its second and third steps exclude the other opens of the key;
* a load checks the call (L1, L2), then runs its loader (L3-L5) in the session's task,
  so a failure of another operation may poison the supervisor in between;
* every other operation (renew, dispose, status) is one step. A burst holds only
  operations that do not wait on virtual time, so each step finishes at once.

:func:`interleave` searches the interleavings of those steps, on copies of the model,
for one whose outcomes are the ones the supervisor gave and whose final state matches
what the machine observed (the store, the children's lives, the calls on them). The
machine adopts the model state it finds; if there is none, the burst is unexplained and
the machine fails. The saves of a burst count as made at one instant
(:meth:`~.reference_store.ModelStore.together`): no outcome tells in which order they
landed, so which records the cap in all evicted is taken from the store.

Independent steps reach the same state in different orders, so the search remembers
the (position, lock, model state) triples that led nowhere; without that, a burst
nothing explains (what a broken adapter produces) costs exponential time.
"""

from __future__ import annotations

import copy
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import attrs

from .._core.supervisor import Supervisor
from ..model import Handle, Key
from ..model import Load as LoadRequest
from .checks import key_name, session_name
from .reference import Model, Outcome, SessionId

__all__ = [
    "Planned",
    "at_once",
    "fingerprint",
    "interleave",
    "plan_burst",
    "plan_call",
    "plan_open",
]


@attrs.frozen
class Planned:
    """One operation of a burst: its model steps, and the call on the real supervisor.

    ``key`` is set for an open: its second and third steps hold that key's lock.
    ``what`` is the call with its arguments, for failure messages.
    """

    name: str
    key: Key | None
    steps: tuple[Callable[[Model], Outcome | None], ...]
    call: Callable[[Supervisor], Awaitable[object]]
    what: str


def plan_open(key: Key, request: str, expected: int | None) -> Planned:
    """An open of ``key`` in its three steps (O1; O3-O5; O6-O8)."""
    return Planned(
        "open",
        key,
        (
            lambda model: model.open_check(),
            lambda model: model.open_supersede(key, request, expected),
            lambda model: model.open_commit(key, request, None),
        ),
        lambda sup: sup.open(key, request, expected_generation=expected),
        f"open({key_name(key)}, {request!r}, expected_generation={expected})",
    )


def plan_call(name: str, ident: SessionId, handle: Handle, specifier: str) -> Planned:
    """A renew, dispose or status of one session, in one step; a load in two (its
    checks in the call, then its loader in the session's task)."""
    if name == "load":
        return Planned(
            name,
            None,
            (
                lambda model: model.load_begin(ident, specifier),
                lambda model: at_once(model.load_run(ident)),
            ),
            lambda sup: sup.load(handle, LoadRequest(specifier=specifier)),
            f"load({session_name(ident)}, {specifier!r})",
        )
    return Planned(
        name,
        None,
        (lambda model: at_once(getattr(model, name)(ident)),),
        lambda sup: getattr(sup, name)(handle),
        f"{name}({session_name(ident)})",
    )


def plan_burst(
    operations: list[tuple[Key, str]],
    twin: bool,
    model: Model,
    handles: Mapping[SessionId, Handle],
    request_id: Callable[[], str],
    specifier: str,
) -> list[Planned] | None:
    """The plan of a burst, or None if one of its operations would wait on virtual time.

    Args:
        operations: Each a key and an operation, to run on the key's latest session
            (an open, for a key that has none).
        twin: Whether a first open is joined by a second open of the same key.
        model: The model as the burst starts.
        handles: The handle of every session opened so far.
        request_id: Makes a fresh request id for an open.
        specifier: What a load loads.
    """
    plan: list[Planned] = []
    for key, name in operations:
        of_key = [ident for ident in handles if ident[0] == key]
        latest = max(of_key, key=lambda ident: ident[1], default=None)
        session = model.sessions.get(latest) if latest else None
        if (
            session is not None
            and session.child is not None
            and (session.child.ignore_interrupt or session.stage != "live")
        ):
            return None
        if name == "open" or latest is None:
            expected = model.store.high.get(key) or None
            plan.append(plan_open(key, request_id(), expected))
            if twin and len(plan) == 1:
                plan.append(plan_open(key, request_id(), expected))
            continue
        plan.append(plan_call(name, latest, handles[latest], specifier))
    return plan


def at_once(steps: Any) -> Outcome:
    """Run a model operation that must not wait."""
    if isinstance(steps, tuple):
        return steps
    try:
        waiting = next(steps)
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]
    raise AssertionError(f"a burst operation waits for {waiting}")


def fingerprint(model: Model) -> str:
    """A text equal for two model states that behave the same from here on."""
    return repr(sorted(vars(model).items()))


def interleave(
    model: Model,
    plan: list[Planned],
    outcomes: list[Outcome | None],
    matches: Callable[[Model], bool],
) -> Model | None:
    """A model state reached by an interleaving of ``plan`` that gives ``outcomes``.

    Args:
        model: The state before the burst; left as it is.
        plan: The operations, in the order they were started.
        outcomes: What each operation gave, in the same order.
        matches: Whether a final state agrees with what was observed after the burst.

    Returns:
        The final state of the first interleaving that explains the burst, or None.
    """
    dead_ends: set[tuple[tuple[int, ...], tuple[tuple[Key, int], ...], str]] = set()

    def search(state: Model, positions: tuple[int, ...], lock: dict[Key, int]) -> Model | None:
        if all(position < 0 for position in positions):
            return state if matches(state) else None
        seen = (positions, tuple(sorted(lock.items(), key=repr)), fingerprint(state))
        if seen in dead_ends:
            return None
        found = explore(state, positions, lock)
        if found is None:
            dead_ends.add(seen)
        return found

    def explore(state: Model, positions: tuple[int, ...], lock: dict[Key, int]) -> Model | None:
        for index, operation in enumerate(plan):
            position = positions[index]
            if position < 0:
                continue
            locked = operation.key is not None and position >= 1
            if locked and lock.get(operation.key, index) != index:  # type: ignore[arg-type]
                continue  # another open of this key holds its lock
            trial = copy.deepcopy(state)
            result = operation.steps[position](trial)
            last = result is not None or position == len(operation.steps) - 1
            if last and result != outcomes[index]:
                continue
            held = dict(lock)
            if operation.key is not None:
                if last:
                    held.pop(operation.key, None)
                elif position >= 1:
                    held[operation.key] = index
            moved = list(positions)
            moved[index] = -1 if last else position + 1
            found = search(trial, tuple(moved), held)
            if found is not None:
                return found
        return None

    # The operations run concurrently: their saves land in an order no outcome may
    # reveal, so they count as made at one instant.
    start = copy.deepcopy(model)
    start.store.join()
    found = search(start, tuple(0 for _ in plan), {})
    if found is not None:
        found.store.leave()
    return found
