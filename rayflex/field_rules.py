"""Per-field constraints of the user-facing configs, declared once beside each field.

A config field states what it accepts with its default, and the config's
``__post_init__`` checks every such field in one call::

    keep: int = setting(3, whole(minimum=1))
    upload: str = setting("auto", one_of(UPLOAD_MODES, "upload mode"))

    def __post_init__(self):
        check_fields(self)          # every field with a rule
        ...                         # then the checks that need several fields

A value that breaks its rule raises :class:`ConfigError` naming ``Class.field``, the value,
and the fix. Torch-free and import-light: the driver and the controller validate configs.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable, Optional

from rayflex.errors import ConfigError

RULE = "rayflex_rule"


@dataclass(frozen=True)
class Rule:
    """``problem(value)`` says what is wrong (None: nothing); ``fix`` says what to do.
    ``optional``: None is accepted (the field's "not set")."""

    problem: Callable[[Any], Optional[str]]
    fix: str
    optional: bool = False


def setting(default: Any = dataclasses.MISSING, rule: Optional[Rule] = None, *,
            default_factory: Any = dataclasses.MISSING) -> Any:
    """A dataclass field carrying ``rule``."""
    return dataclasses.field(default=default, default_factory=default_factory,
                             metadata={RULE: rule} if rule is not None else {})


def check_fields(obj: Any) -> None:
    """Raise on the first field of ``obj`` (in declaration order) that breaks its rule."""
    for f in dataclasses.fields(obj):
        rule = f.metadata.get(RULE)
        if rule is not None:
            check_value(f"{type(obj).__name__}.{f.name}", getattr(obj, f.name), rule)


def check_value(where: str, value: Any, rule: Rule) -> None:
    """One value against a rule outside a dataclass field (a resolved or derived value)."""
    if value is None and rule.optional:
        return
    problem = rule.problem(value)
    if problem:
        raise ConfigError(where, problem, rule.fix)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def whole(minimum: int, fix: Optional[str] = None, *, optional: bool = False) -> Rule:
    """An integer >= ``minimum`` (0 or 1)."""
    phrase = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"

    def problem(value):
        return None if _is_int(value) and value >= minimum else f"must be {phrase}, got {value!r}"
    return Rule(problem, fix or f"use an integer >= {minimum}", optional)


def number(*, fix: str, gt: Optional[float] = None, ge: Optional[float] = None, le: Optional[float] = None,
           unit: str = "", optional: bool = False) -> Rule:
    """A finite int or float within the bounds given (``unit``: what the number counts,
    e.g. "seconds", for the message)."""
    bounds = [f"> {gt:g}" if gt is not None else "", f">= {ge:g}" if ge is not None else "",
              f"<= {le:g}" if le is not None else ""]
    said = " and ".join(b for b in bounds if b)
    what = f"a number of {unit}" if unit else "a number"
    phrase = f"{what} {said}".strip() + (" or None" if optional else "")

    def problem(value):
        ok = (_is_number(value) and math.isfinite(value) and (gt is None or value > gt)
              and (ge is None or value >= ge) and (le is None or value <= le))
        return None if ok else f"must be {phrase}, got {value!r}"
    return Rule(problem, fix, optional)


def one_of(choices: tuple, what: str, fix: Optional[str] = None, *, optional: bool = False) -> Rule:
    """One of ``choices``; the message calls a wrong value an unknown ``what``."""
    def problem(value):
        return None if value in choices else f"unknown {what} {value!r}"
    return Rule(problem, fix or f"use one of {', '.join(str(c) for c in choices)}", optional)


def flag(fix: str) -> Rule:
    """True or False (not 0/1 or a string: a typo must not read as a choice)."""
    def problem(value):
        return None if isinstance(value, bool) else f"must be True or False, got {value!r}"
    return Rule(problem, fix)


def text(fix: str, *, what: str = "a non-empty string", optional: bool = False) -> Rule:
    """A non-empty string."""
    def problem(value):
        return None if isinstance(value, str) and value else f"must be {what}, got {value!r}"
    return Rule(problem, fix, optional)


def mapping(what: str, fix: str) -> Rule:
    """A dict (``what``: of what to what, for the message)."""
    def problem(value):
        return None if isinstance(value, dict) else f"must be a dict of {what}, got {value!r}"
    return Rule(problem, fix)


def custom(problem: Callable[[Any], Optional[str]], fix: str, *, optional: bool = False) -> Rule:
    """A rule of the field's own (a format, a pattern)."""
    return Rule(problem, fix, optional)
