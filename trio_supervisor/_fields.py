"""The checks every value's fields go through, and the freezing of JSON configs.

Each check names the class and the field (``Limits.cpu_seconds must be ...``), so the
error says exactly what was wrong; ``model.py`` puts them on its fields. A check that
bounds a value (a minimum, a length) is a :class:`Check`, which also states its bounds
as JSON Schema keywords: the runner's OpenAPI document reads them from the check itself,
so the document and the check cannot disagree. Nothing here does I/O or knows about Trio.
"""

from __future__ import annotations

import math
import sys
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final, TypeAlias

import attrs

#: A JSON value: what a :class:`~trio_supervisor.Load`'s ``config`` may hold.
JSON: TypeAlias = bool | int | float | str | Sequence["JSON"] | Mapping[str, "JSON"] | None

#: The most characters of a key's identity, and of its instance.
MAX_KEY_LENGTH: Final = 128
#: The shortest lease a caller may ask for, in seconds: below this, renewing would be
#: most of what a host does.
MIN_LEASE: Final = 0.1
#: The longest lease a caller may ask for, in seconds (about 31 years). A child's lease
#: watchdog waits in select(), which cannot wait past ~9.2e9 seconds: with a longer
#: lease its thread died and its load never returned (found by fuzzing the service).
MAX_LEASE: Final = 1e9


def where(instance: object, attribute: attrs.Attribute[Any]) -> str:
    return f"{type(instance).__name__}.{attribute.name}"


class Check:
    """A field validator that also states what it accepts, as JSON Schema keywords.

    Called as an attrs validator, it names the field as ``Class.field``; called through
    :meth:`check`, it names the value as the caller says (``--lease``, ``lease``).

    Attributes:
        schema: The JSON Schema keywords of what the check accepts (``minLength``,
            ``minimum``, ...), for a value of the field's type.
    """

    __slots__ = ("_refuse", "schema")

    def __init__(self, refuse: Callable[[str, object], None], **schema: Any) -> None:
        self._refuse = refuse
        self.schema: Mapping[str, Any] = types.MappingProxyType(schema)

    def check(self, name: str, value: object) -> None:
        """Refuse ``value`` with an error naming it ``name``, unless it passes.

        Raises:
            TypeError: The value is of the wrong type.
            ValueError: The value is out of bounds.
        """
        self._refuse(name, value)

    def __call__(self, instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
        # Every record built checks its fields: the field's name is only spelled out for
        # a value that fails (a try costs nothing when nothing is raised).
        try:
            self._refuse("", value)
        except (TypeError, ValueError):
            self._refuse(where(instance, attribute), value)


def _text(name: str, value: object) -> None:
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str, not {type(value).__name__}")
    if not value:
        raise ValueError(f"{name} must not be empty")


text: Final = Check(_text, minLength=1)


def _key_text(name: str, value: object) -> None:
    _text(name, value)
    assert isinstance(value, str)
    if len(value) > MAX_KEY_LENGTH:
        raise ValueError(f"{name} must be at most {MAX_KEY_LENGTH} characters, got {len(value)}")


# A key's identity or instance: not empty, and short enough to read in a table of sessions.
key_text: Final = Check(_key_text, minLength=1, maxLength=MAX_KEY_LENGTH)


def optional_text(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value is not None and not isinstance(value, str):
        raise TypeError(
            f"{where(instance, attribute)} must be a str or None, not {type(value).__name__}"
        )


def integer(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        _integer(where(instance, attribute), value)


def optional_integer(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value is not None:
        integer(instance, attribute, value)


def _integer(name: str, value: object) -> None:
    # bool is an int to Python, never to us.
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, not {type(value).__name__}")


def at_least(minimum: int) -> Check:
    """An int no smaller than ``minimum``."""

    def refuse(name: str, value: object) -> None:
        _integer(name, value)
        assert isinstance(value, int)
        if value < minimum:
            raise ValueError(f"{name} must be >= {minimum}, got {value}")

    return Check(refuse, minimum=minimum)


def optional(check: Check) -> Check:
    """``check``, or None; the schema is the check's, for the value that is not None."""

    def refuse(name: str, value: object) -> None:
        if value is not None:
            check.check(name, value)

    return Check(refuse, **check.schema)


def _limit(name: str, value: object) -> None:
    if value is None:
        return
    _integer(name, value)
    assert isinstance(value, int)
    if value < 0:
        raise ValueError(f"{name} must be None (no limit) or >= 0, got {value}")


limit: Final = Check(_limit, minimum=0)


def _starting_limit(why: str) -> Check:
    """A :data:`limit` that may not be 0 either, since a child with none of it cannot
    start (``why`` says so in its words)."""

    def refuse(name: str, value: object) -> None:
        _limit(name, value)
        if value == 0:
            raise ValueError(f"{name} must be None (no limit) or >= 1, got 0: {why}")

    return Check(refuse, minimum=1)


cpu_limit: Final = _starting_limit("a child with no CPU time cannot start")
tree_limit: Final = _starting_limit("a child allowed none cannot start")


def as_float(value: object) -> object:
    return float(value) if isinstance(value, int) and not isinstance(value, bool) else value


def _number(value: float) -> str:
    return str(int(value)) if value.is_integer() else repr(value)


class Seconds(Check):
    """A duration: a finite number of seconds within bounds; the one check of every
    lease, grace and timeout, so that each is refused in the same words.

    Args:
        minimum: The smallest duration accepted.
        inclusive: Whether ``minimum`` itself is accepted.
        maximum: The largest duration accepted, if any.
    """

    __slots__ = ("_ceiling", "inclusive", "maximum", "minimum")

    def __init__(
        self, *, minimum: float = 0.0, inclusive: bool = False, maximum: float | None = None
    ) -> None:
        self.minimum = minimum
        self.inclusive = inclusive
        self.maximum = maximum
        # The largest float accepted: a float no larger is finite (inf and nan fail).
        self._ceiling = sys.float_info.max if maximum is None else maximum
        low = "minimum" if inclusive else "exclusiveMinimum"
        high = {} if maximum is None else {"maximum": maximum}
        super().__init__(self._refuse_seconds, **{low: minimum}, **high)

    @property
    def bounds(self) -> str:
        """The bounds in words: ``> 0``, ``>= 0.1 and <= 1000000000``."""
        low = f"{'>=' if self.inclusive else '>'} {_number(self.minimum)}"
        return low if self.maximum is None else f"{low} and <= {_number(self.maximum)}"

    def seconds(self, name: str, value: object) -> float:
        """``value`` as a float, once checked.

        Raises:
            TypeError: ``value`` is not a number (a bool is not one).
            ValueError: It is not finite, or out of bounds; the message names ``name``.
        """
        self._refuse_seconds(name, value)
        assert isinstance(value, int | float)
        return float(value)  # finite and bounded: it converts

    def _refuse_seconds(self, name: str, value: object) -> None:
        # The common case first, in a few comparisons: every record built checks a lease.
        if (
            type(value) is float
            and value <= self._ceiling
            and (value > self.minimum or (self.inclusive and value == self.minimum))
        ):
            return
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise TypeError(f"{name} must be a number of seconds, not {type(value).__name__}")
        try:
            seconds = float(value)
        except OverflowError:  # an int past any float: out of bounds, not a crash
            seconds = math.inf
        low = seconds >= self.minimum if self.inclusive else seconds > self.minimum
        high = self.maximum is None or seconds <= self.maximum
        if not (math.isfinite(seconds) and low and high):
            raise ValueError(
                f"{name} must be a finite number of seconds {self.bounds}, got {value!r}"
            )


# A lease a caller asks for (the supervisor's default, an open's, a runner's).
LEASE: Final = Seconds(minimum=MIN_LEASE, inclusive=True, maximum=MAX_LEASE)
# A lease as a record holds it: any a supervisor ever granted, also before the minimum.
RECORDED_LEASE: Final = Seconds()
GRACE: Final = Seconds(inclusive=True)  # 0: the interrupt gets no time, the kill follows
TIMEOUT: Final = Seconds()


def freeze_json(value: object, where: str = "config") -> Any:
    """Copy a JSON value into an immutable one: mappings become read-only, lists tuples."""
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{where} holds {value!r}, which JSON cannot represent")
        return value
    if isinstance(value, Mapping):
        frozen: dict[str, Any] = {}
        for name, item in value.items():
            if not isinstance(name, str):
                raise TypeError(f"{where} has a key {name!r}; JSON object keys are strings")
            frozen[name] = freeze_json(item, f"{where}[{name!r}]")
        return types.MappingProxyType(frozen)
    if isinstance(value, list | tuple):
        return tuple(freeze_json(item, f"{where}[{index}]") for index, item in enumerate(value))
    raise TypeError(f"{where} holds a {type(value).__name__}, which is not a JSON value")


def thaw(value: object) -> Any:
    """The plain JSON form of a frozen JSON value: read-only mappings become dicts,
    tuples (and lists) become lists. The inverse of what ``Load`` does to its config.

    Args:
        value: A JSON value, frozen or not (a ``Load.config``, say).

    Returns:
        The same value made of dicts and lists, which ``json.dumps`` takes.
    """
    if isinstance(value, Mapping):
        return {name: thaw(item) for name, item in value.items()}
    if isinstance(value, tuple | list):
        return [thaw(item) for item in value]
    return value


def freeze_config(value: object) -> Mapping[str, JSON]:
    if not isinstance(value, Mapping):
        raise TypeError(f"Load.config must be a mapping, not {type(value).__name__}")
    frozen: Mapping[str, JSON] = freeze_json(value, "Load.config")
    return frozen


def plain_integer(value: object) -> object:
    # A signal number is often a ``signal.Signals`` member; stored, it reads back as a
    # plain int, so it is one from the start (the same value before and after storage).
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else value


def _count(name: str, value: object) -> None:
    _integer(name, value)
    assert isinstance(value, int)
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")


count: Final = Check(_count, minimum=0)


def flag(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{where(instance, attribute)} must be a bool, not {type(value).__name__}")
