"""The conformance machine: random operation sequences against the reference model.

``conformance_machine(store_factory, harness_factory)`` returns a Hypothesis
``RuleBasedStateMachine`` that drives a real supervisor on your store and execution,
and holds every result against the reference model of docs/design.md
(:mod:`.reference`). The pieces:

* :mod:`.world`: one example's Trio run on a virtual clock, in a background thread;
  the rules call into it. An operation that waits on virtual time stays pending; the
  model says when it ends.
* this module: the rules (what the machine does: opens, renews, loads, disposes, child
  exits, children that ignore signals, storage faults, clean and crashing restarts,
  concurrent bursts) and, for each, the model's prediction, checked at once.
* :mod:`.interleavings`: a concurrent burst is explained by some interleaving of its
  operations' atomic steps.
* :mod:`.checks`: the invariants held after every step (the store, the high-water
  marks, the children's lives and calls, the order of signals, the clocks) and the
  failure messages, which name the promise that broke and the call or record.

Each example starts (``start``, an initialize rule) by drawing a small retention (1 or 2
Stopped records per key, 2 to 5 in all, and a ``stopped_for`` of 0 or a day) and asking
``store_factory(None, retention)`` for a store, so that eviction per key and in all
happens in ordinary examples.
"""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Awaitable, Callable
from typing import Any, ClassVar

import attrs
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from .._core.supervisor import Supervisor
from ..model import ExitStatus, Handle, Key
from ..model import Load as LoadRequest
from ..retention import Retention
from .checks import (
    agreement,
    check_children,
    check_clock,
    check_outcome,
    check_signals_follow_stopping,
    check_store,
    key_name,
    session_name,
    stored,
    unexplained_burst,
)
from .harnesses import FakeHarness, Harness
from .interleavings import interleave, plan_burst
from .reference import Ending, Model, Outcome, Pending, SessionId, ok
from .reference_store import refusing
from .world import CONFIRMATION, GRACE, LEASE, RECORDS, Operation, StoreFactory, World

__all__ = ["KEYS", "PROFILE", "ConformanceMachine", "StoreFactory", "conformance_machine"]

KEYS = tuple(Key(identity="conformance", instance=name) for name in "abc")
LEASES = (1.0, 2.5, 4.0, None)
STEPS = (0.5, 1.0, 2.0, 4.0, 8.0)
# A stopped_for no example outlasts by the stores' wall clock: every Stopped record is
# young throughout, so a key keeps all of its own, up to the cap in all.
KEPT_FOR = 86_400.0

# Examples a machine, and steps an example. "short" is this project's suite's pass over
# adapters beyond the first: the same rules, each machine's own paths a while longer.
_PROFILES = (("ci", 500, 30), ("short", 150, 30), ("deep", 7000, 50), ("quick", 20, 20))
for _profile, _examples, _steps in _PROFILES:
    settings.register_profile(
        f"trio_supervisor-{_profile}",
        max_examples=_examples,
        stateful_step_count=_steps,
        deadline=None,
        print_blob=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
PROFILE = os.environ.get("TRIO_SUPERVISOR_CONFORMANCE", "ci")


class ConformanceMachine(RuleBasedStateMachine):
    """The rules and invariants; :func:`conformance_machine` binds it to adapters."""

    store_factory: ClassVar[StoreFactory]
    harness_factory: ClassVar[Callable[[], Harness]]
    restartable: ClassVar[bool] = True
    store_answers_outside: ClassVar[bool | None] = None

    world: World
    model: Model

    def __init__(self) -> None:
        super().__init__()
        self.harness = type(self).harness_factory()
        self.handles: dict[SessionId, Handle] = {}
        self.pending: list[tuple[Pending, Operation]] = []
        self._requests = itertools.count(1)
        self._started = False

    @initialize(
        per_key=st.integers(1, 2),
        total=st.integers(2, 5),
        kept_for=st.sampled_from([0.0, KEPT_FOR]),
    )
    def start(self, per_key: int, total: int, kept_for: float) -> None:
        """A fresh store with a small retention, so that eviction, per key and in all,
        happens in ordinary examples; and a supervisor on it."""
        retention = Retention(stopped_per_key=per_key, stopped_total=total, stopped_for=kept_for)
        harness = self.harness

        def exit_status(ending: Ending, code: int) -> ExitStatus:
            # A plain function: the model is deep-copied while bursts are explained.
            return harness.exit_status(ending, code)

        self.world = World(
            type(self).store_factory, harness, retention, type(self).store_answers_outside
        )
        self._started = True
        self.model = Model(
            lease=LEASE,
            grace=GRACE,
            confirmation=CONFIRMATION,
            stopped_per_key=per_key,
            stopped_total=total,
            stopped_for=kept_for,
            missing=harness.missing,
            broken=harness.broken,
            exit_status=exit_status,
        )
        given = self.world.store.retention
        assert given == retention, (
            f"store_factory(previous, retention) must make a store with that retention: "
            f"asked for {retention}, the store has {given}"
        )
        failure = self.world.call(self.world.enter)
        assert failure is None, f"the supervisor did not start on a fresh store: {failure!r}"

    def teardown(self) -> None:
        if self._started:
            self.world.close()

    # -- how a step is checked --------------------------------------------------------------

    def _check(self, predicted: Pending, actual: Operation) -> None:
        outcome = predicted.outcome
        event(f"{actual.name} -> {outcome[0] if outcome else 'waits'}")
        if outcome is not None and outcome[0] == "error":
            event(f"{actual.name} -> {outcome[1]}")
        self._learn_poisoning()
        check_outcome(outcome, actual, alike=self.model.poisoned_with)
        if outcome is None:
            self.pending.append((predicted, actual))
        else:
            self._adopt(actual)

    def _adopt(self, actual: Operation) -> None:
        value = actual.value
        if actual.name == "open" and isinstance(value, RECORDS):
            handle = value.handle
            self.handles[(handle.key, handle.generation)] = handle

    def _settle_pending(self) -> None:
        self._learn_poisoning()
        for predicted, actual in list(self.pending):
            check_outcome(predicted.outcome, actual, waited=True, alike=self.model.poisoned_with)
            if predicted.outcome is not None:
                event(f"{actual.name} waited, then -> {predicted.outcome}")
                self.pending.remove((predicted, actual))
                self._adopt(actual)

    def _learn_poisoning(self, *, settled: bool = False) -> None:
        """Poisonings at one instant come in the scheduler's order: take the supervisor's."""
        supervisor = self.world.supervisor
        error = supervisor.poisoned if supervisor is not None else None
        self.model.learn_poisoning(type(error).__name__ if error else None, settled=settled)

    def _run(
        self,
        name: str,
        predicted: Any,
        call: Callable[[Supervisor], Awaitable[object]],
        what: str,
    ) -> None:
        expected = self.model.start(name, predicted)
        actual = self.world.call(self.world.begin, name, call)
        actual.what = what
        self._check(expected, actual)

    def _call(self, name: str, ident: SessionId | None) -> None:
        """Run renew, dispose or status on a known session, and check it."""
        assert ident is not None
        handle = self.handles[ident]
        self._run(
            name,
            getattr(self.model, name)(ident),
            lambda sup: getattr(sup, name)(handle),
            f"{name}({session_name(ident)})",
        )

    # -- choosing sessions ------------------------------------------------------------------

    def _known(self) -> list[SessionId]:
        return sorted(self.handles, key=lambda ident: (ident[0].instance, ident[1]))

    def _pick(self, pick: int, among: list[SessionId]) -> SessionId | None:
        return among[pick % len(among)] if among else None

    def _running_children(self) -> list[SessionId]:
        return [ident for ident in self.model.running_children() if ident in self.handles]

    def _busy_keys(self) -> set[Key]:
        """Keys with an operation waiting on one of their sessions.

        A second open of such a key would queue behind the first on the key's lock,
        which the model does not keep; the machine does not ask for it.
        """
        return {predicted.waiting.key for predicted, _ in self.pending if predicted.waiting}

    # -- rules: open, renew, load, dispose, status ------------------------------------------

    @rule(
        which=st.integers(0, 2),
        how=st.sampled_from(["next", "next", "next", "next", "wrong", "none", "repeat"]),
        lease=st.sampled_from(LEASES),
        offset=st.sampled_from([-1, 1, 2]),
    )
    def open(self, which: int, how: str, lease: float | None, offset: int) -> None:
        """Open a key: at its next generation, with a wrong or no expected generation,
        or again with a request id already used."""
        key = KEYS[which]
        if key in self._busy_keys():
            return
        high = self.model.store.high.get(key, 0)
        expected: int | None = high or None
        request = f"request-{next(self._requests)}"
        if how == "wrong":
            expected = max(high + offset, 0)
            expected = expected + 1 if expected == high else expected
        elif how == "none":
            expected = None
        elif how == "repeat":
            kept = self.model.store.records
            used = [ident for ident in kept if ident[0] == key]
            if used:
                request = kept[max(used, key=lambda ident: ident[1])].request_id
        self._run(
            "open",
            self.model.open(key, request, expected, lease),
            lambda sup: sup.open(key, request, expected_generation=expected, lease=lease),
            f"open({key_name(key)}, {request!r}, expected_generation={expected}, lease={lease})",
        )

    def _choose(self, pick: int) -> SessionId | None:
        """A known session, live ones three times as likely."""
        known = self._known()
        live = [
            ident
            for ident in known
            if ident in self.model.sessions and self.model.sessions[ident].reason is None
        ]
        if live and pick % 4:
            return live[pick // 4 % len(live)]
        return self._pick(pick, known)

    @precondition(lambda self: bool(self.handles))
    @rule(pick=st.integers(0, 1000))
    def renew(self, pick: int) -> None:
        """Renew a known session, and check the outcome (R1-R6)."""
        self._call("renew", self._choose(pick))

    @precondition(lambda self: bool(self.handles))
    @rule(
        pick=st.integers(0, 1000),
        which=st.sampled_from(["first", "first", "other", "missing", "broken"]),
    )
    def load(self, pick: int, which: str) -> None:
        """Load a known session: its first or other specifier, a missing or broken one (L1-L6)."""
        ident = self._choose(pick)
        assert ident is not None
        harness = self.harness
        specifier = {
            "first": harness.specifiers[0],
            "other": harness.specifiers[1],
            "missing": harness.missing,
            "broken": harness.broken or harness.specifiers[0],
        }[which]
        handle = self.handles[ident]
        self._run(
            "load",
            self.model.load(ident, specifier),
            lambda sup: sup.load(handle, LoadRequest(specifier=specifier)),
            f"load({session_name(ident)}, {specifier!r})",
        )

    @precondition(lambda self: bool(self.handles))
    @rule(pick=st.integers(0, 1000))
    def dispose(self, pick: int) -> None:
        """Dispose a known session (D1-D5)."""
        self._call("dispose", self._choose(pick))

    @precondition(lambda self: bool(self.handles))
    @rule(pick=st.integers(0, 1000))
    def status(self, pick: int) -> None:
        """Read a known session's status (S1)."""
        self._call("status", self._pick(pick, self._known()))

    @precondition(lambda self: bool(self.handles))
    @rule(pick=st.integers(0, 1000), how=st.sampled_from(["generation", "token", "key"]))
    def stale_handles_are_refused(self, pick: int, how: str) -> None:
        """Renew, status and dispose with a wrong generation, token or key: stale (R2, D2, S1)."""
        ident = self._pick(pick, self._known())
        assert ident is not None
        handle = self.handles[ident]
        if how == "generation":
            stale = attrs.evolve(handle, generation=handle.generation + 100)
        elif how == "token":
            stale = attrs.evolve(handle, token="f" * 36)
        else:
            stale = attrs.evolve(handle, key=Key(identity="conformance", instance="elsewhere"))
        stale_error: Outcome = ("error", "StaleSessionError")
        for name in ("renew", "status", "dispose"):
            actual = self.world.call(
                self.world.begin, name, lambda sup, n=name: getattr(sup, n)(stale)
            )
            actual.what = f"{name}({session_name(ident)} with a wrong {how}: a stale handle)"
            # Renew checks the supervisor's health first (R1); status and dispose do not.
            expected = (self.model._usable() if name == "renew" else None) or stale_error
            check_outcome(expected, actual)

    # -- rules: children ------------------------------------------------------------------

    @precondition(lambda self: bool(self._running_children()))
    @rule(pick=st.integers(0, 1000), code=st.integers(0, 3))
    def child_exits_by_itself(self, pick: int, code: int) -> None:
        """A running child exits by itself with ``code`` (X1)."""
        ident = self._pick(pick, self._running_children())
        assert ident is not None
        child = self.world.log.children[ident]
        handle = self.handles[ident]
        self.model.child_exits(ident, code)
        self.world.call(self.world.run_sync, lambda: self.harness.exit(handle, child, code))
        self._settle_pending()

    @precondition(lambda self: self.harness.scripted and bool(self._running_children()))
    @rule(pick=st.integers(0, 1000), kill_too=st.booleans())
    def child_ignores_signals(self, pick: int, kill_too: bool) -> None:
        """A running child ignores its interrupt, or its kill too (P3; scripted harnesses only)."""
        ident = self._pick(pick, self._running_children())
        assert ident is not None
        child = self.world.log.children[ident]
        self.model.ignore(ident, interrupt=True, kill=kill_too)
        self.world.call(
            self.world.run_sync, lambda: self.harness.ignore(child, interrupt=True, kill=kill_too)
        )

    # -- rules: time --------------------------------------------------------------------

    @rule(step=st.sampled_from(STEPS))
    def advance_time(self, step: float) -> None:
        """Move the virtual clock on: leases expire, graces end (T1, P3)."""
        target = self.model.now + step
        self.model.advance(target)
        self.world.call(self.world.advance, target)
        self._settle_pending()

    @precondition(lambda self: bool(self.pending) and self.model.next_event() < math.inf)
    @rule()
    def advance_to_the_next_deadline(self) -> None:
        """While something waits, move time to the next deadline (often its end)."""
        target = self.model.next_event()
        self.model.advance(target)
        self.world.call(self.world.advance, target)
        self._settle_pending()

    # -- rules: storage faults ----------------------------------------------------------

    @rule(which=st.integers(0, 1000), dice=st.integers(0, 2))
    def fail_the_next_save_of_a_session(self, which: int, dice: int) -> None:
        """One save fails: the next of a session, or the next Open of a key (1 in 3)."""
        if dice:
            return
        candidates: list[SessionId | Key] = [*self._known(), *KEYS]
        refuse = refusing(candidates[which % len(candidates)])
        self.model.store.faults.once.append(refuse)
        self.world.faults.once.append(refuse)

    @precondition(lambda self: len(self.handles) >= 4)
    @rule(dice=st.integers(0, 4))
    def fail_every_save_from_now_on(self, dice: int) -> None:
        """The disk is gone (1 in 5, once a few sessions exist); restarts heal it."""
        if dice:
            return
        self.model.store.faults.broken = True
        self.world.faults.broken = True

    # -- rules: restarts ------------------------------------------------------------------

    @precondition(lambda self: type(self).restartable)
    @rule(crash=st.booleans())
    def restart(self, crash: bool) -> None:
        """Shut the supervisor down (Z1-Z3) or crash it, then start one on the store (V1-V5)."""
        world, model = self.world, self.model
        alive = sum(1 for child in model.children.values() if child.alive)
        event(f"restart ({'crash' if crash else 'clean'}) with {min(alive, 3)}+ children alive")
        if crash:
            model.crash()
            world.call(world.crash)
        else:
            _, raises = model.shutdown()
            failure = world.call(world.shutdown)
            if raises:
                assert isinstance(failure, BaseExceptionGroup), (
                    f"leaving a poisoned supervisor must raise an error group (Z3), got {failure!r}"
                )
            else:
                assert failure is None, f"a clean shutdown raised {failure!r} (Z3)"
        if not crash:
            self._settle_pending()
        self.pending.clear()
        world.call(world.reopen_store)
        expected = model.recover()
        failure = world.call(world.enter)
        if expected != ok():
            assert failure is not None, (
                f"recovery must fail with {expected[1]}: an orphan ignores its kill (V2)"
            )
            assert type(failure).__name__ == expected[1], (
                f"recovery must fail with {expected[1]} (V2), it raised {failure!r}"
            )
            event("recovery could not confirm an orphan")
            # An operator ends the children that would not die, and starts again.
            for ident in list(model.immortal_orphans()):
                model.children[ident].ignore_kill = False
                child = world.log.children[ident]
                world.call(world.run_sync, lambda child=child: self.harness.heal(child))
            expected = model.recover()
            failure = world.call(world.enter)
        assert expected == ok()
        assert failure is None, f"the supervisor did not start (V1-V5): {failure!r}"

    # -- rules: bursts --------------------------------------------------------------------

    @precondition(lambda self: not self.pending)
    @rule(
        ops=st.lists(
            st.tuples(
                st.integers(0, 2), st.sampled_from(["open", "renew", "dispose", "status", "load"])
            ),
            min_size=2,
            max_size=3,
            unique_by=lambda op: op[0],
        ),
        twin=st.booleans(),
    )
    def concurrent_burst(self, ops: list[tuple[int, str]], twin: bool) -> None:
        """Operations on different keys (and maybe two opens of one key) started at once.

        The outcomes and the store must be explained by some interleaving of the
        operations' atomic steps: an open checks the health (O1), takes the key's lock
        to check and supersede (O3-O5), and checks again and saves (O6-O8); every other
        operation is one step.
        """
        plan = plan_burst(
            [(KEYS[which], name) for which, name in ops],
            twin,
            self.model,
            self.handles,
            lambda: f"request-{next(self._requests)}",
            self.harness.specifiers[0],
        )
        if plan is None:
            return  # an operation would wait on virtual time; bursts stay instantaneous
        actual = self.world.call(self.world.burst, [(step.name, step.call) for step in plan])
        for step, operation in zip(plan, actual, strict=True):
            operation.what = step.what
        seen = self.world.call(self.world.observe)
        outcomes = [operation.outcome for operation in actual]
        explained = interleave(self.model, plan, outcomes, agreement(seen))
        if explained is None:
            # An order that gives these outcomes, if one does, names what else broke.
            near = interleave(self.model, plan, outcomes, lambda state: True)
            unexplained_burst(seen, actual, near)
        event(f"burst of {len(plan)} explained")
        self.model = explained
        for operation in actual:
            self._adopt(operation)

    # -- invariants ---------------------------------------------------------------------

    @invariant()
    def the_run_agrees_with_the_model(self) -> None:
        """The clocks, the store, the children and their calls, the order of signals."""
        seen = self.world.call(self.world.observe)
        # What the model could not order at one instant, it takes from the run.
        self.model.store.resolve(stored(seen.records))
        self._learn_poisoning(settled=True)
        check_clock(seen, self.model)
        check_store(seen, self.model)
        check_children(seen, self.model)
        check_signals_follow_stopping(self.world.log)


def conformance_machine(
    store_factory: StoreFactory,
    harness_factory: Callable[[], Harness] | None = None,
    *,
    restartable: bool = True,
    profile: str | None = None,
    store_answers_outside: bool | None = None,
) -> type[ConformanceMachine]:
    """Build the conformance machine for a store and an execution adapter.

    Args:
        store_factory: ``store_factory(previous, retention)``, the shape the contract
            kit's ``StoreContract`` uses. Called with None and the example's retention
            for a fresh store at the start of an example (the machine draws a small
            retention, 1 or 2 Stopped records per key and 2 to 5 in all, and a
            ``stopped_for`` of 0 or a day, so that eviction happens often), and with
            the previous store (already closed, if it has ``aclose``) and the same
            retention when the machine restarts the supervisor: return the same
            storage again (a ``MemoryStore`` returns itself; a file store reopens its
            file). The store must apply ``retention`` and report it as its
            ``retention``.
        harness_factory: Makes the execution adapter's harness, one per example; the
            scriptable fake by default.
        restartable: Whether the machine restarts (cleanly, and by crashing).
        profile: ``"ci"`` (500 examples), ``"short"`` (150), ``"deep"`` (7,000) or
            ``"quick"`` (20, a smoke test); by default ``$TRIO_SUPERVISOR_CONFORMANCE``,
            else ``"ci"``.
        store_answers_outside: Whether the store's answers come from outside the Trio
            run (a worker thread, a socket). The machine then makes one store call at a
            time, once every other task waits, so that an example replays exactly
            (Hypothesis requires it) whatever the thread's timing. By default: True for
            any store but a ``MemoryStore``. Say False only for a store that answers
            within the run: the machine then explores more interleavings.

    Returns:
        A ``RuleBasedStateMachine`` subclass; pytest collects its ``TestCase``.
    """
    chosen = profile or PROFILE
    harness = harness_factory or FakeHarness

    class Conformance(ConformanceMachine):
        pass

    Conformance.store_factory = staticmethod(store_factory)
    Conformance.harness_factory = staticmethod(harness)
    Conformance.restartable = restartable
    Conformance.store_answers_outside = store_answers_outside
    Conformance.TestCase.settings = settings.get_profile(f"trio_supervisor-{chosen}")
    return Conformance
