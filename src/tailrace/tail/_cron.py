"""Cron expressions, parsed and stepped with the standard library (for schedules, W4).

Five fields, in UTC: minute (0-59), hour (0-23), day of month (1-31),
month (1-12 or ``jan``-``dec``) and day of week (0-7 or ``sun``-``sat``; 0
and 7 are Sunday). A field is ``*``, a value, a range ``a-b``, a step
``*/n``, ``a-b/n`` or ``a/n`` (from ``a`` to the field's end), or a list of
those separated by commas. When both the day of month and the day of week
are restricted, a day matching either is a tick (as Vixie cron does).
``@hourly``, ``@daily`` (``@midnight``), ``@weekly``, ``@monthly`` and
``@yearly`` (``@annually``) stand for their usual expressions.

>>> cron = Cron("*/15 9-17 * * mon-fri")
>>> import datetime as dt
>>> at = dt.datetime(2026, 12, 4, 17, 50, tzinfo=dt.timezone.utc).timestamp()  # a Friday
>>> dt.datetime.fromtimestamp(cron.next_after(at), dt.timezone.utc).isoformat()
'2026-12-07T09:00:00+00:00'
>>> dt.datetime.fromtimestamp(cron.latest_at(at), dt.timezone.utc).isoformat()
'2026-12-04T17:45:00+00:00'
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field

_UTC = datetime.UTC
_MONTHS = ("jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec")
_DAYS = ("sun", "mon", "tue", "wed", "thu", "fri", "sat")
_MACROS = {
    "@yearly": "0 0 1 1 *",
    "@annually": "0 0 1 1 *",
    "@monthly": "0 0 1 * *",
    "@weekly": "0 0 * * 0",
    "@daily": "0 0 * * *",
    "@midnight": "0 0 * * *",
    "@hourly": "0 * * * *",
}
#: (name, lowest, highest, names for values) of each field, in order.
_FIELDS = (
    ("minute", 0, 59, ()),
    ("hour", 0, 23, ()),
    ("day of month", 1, 31, ()),
    ("month", 1, 12, _MONTHS),
    ("day of week", 0, 7, _DAYS),
)
#: Steps a search takes at most (minutes, hours, days or months skipped). An
#: expression that parses has a tick at least every four years (February 29),
#: which takes a few hundred steps to reach.
_MAX_STEPS = 20_000
#: The most days each month has (February in a leap year).
_MONTH_DAYS = (31, 29, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31)


def _value(text: str, low: int, high: int, names: tuple[str, ...], what: str, expr: str) -> int:
    word = text.lower()
    if word in names:
        return names.index(word) + (low if what == "month" else 0)
    if not word.isdigit():
        raise ValueError(f"cron {expr!r}: {what} {text!r} is not a number or a name")
    number = int(word)
    if not low <= number <= high:
        raise ValueError(f"cron {expr!r}: {what} {number} is outside {low}..{high}")
    return number


def _field(text: str, index: int, expr: str) -> frozenset[int]:
    what, low, high, names = _FIELDS[index]
    values: set[int] = set()
    for part in text.split(","):
        span, slash, step_text = part.partition("/")
        step = 1
        if slash:
            if not step_text.isdigit() or int(step_text) < 1:
                raise ValueError(f"cron {expr!r}: {what} step {step_text!r} is not a count >= 1")
            step = int(step_text)
        if span == "*":
            first, last = low, high
        elif "-" in span:
            a, _, b = span.partition("-")
            first = _value(a, low, high, names, what, expr)
            last = _value(b, low, high, names, what, expr)
            if first > last:
                raise ValueError(f"cron {expr!r}: {what} range {span!r} runs backwards")
        else:
            first = _value(span, low, high, names, what, expr)
            last = high if slash else first
        values.update(range(first, last + 1, step))
    if index == 4 and 7 in values:  # Sunday is 0 and 7
        values = (values - {7}) | {0}
    return frozenset(values)


@dataclass(frozen=True, slots=True)
class Cron:
    """A parsed cron expression (see the module): its ticks are whole minutes, in UTC.

    Args:
        expr: five fields, or a macro such as ``@daily``; a bad one raises
            ``ValueError`` naming the field and the value.
    """

    expr: str
    minutes: frozenset[int] = field(init=False, repr=False)
    hours: frozenset[int] = field(init=False, repr=False)
    days: frozenset[int] = field(init=False, repr=False)
    months: frozenset[int] = field(init=False, repr=False)
    weekdays: frozenset[int] = field(init=False, repr=False)
    any_day: bool = field(init=False, repr=False)
    any_weekday: bool = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.expr, str):
            raise ValueError(f"a cron expression must be a string, got {self.expr!r}")
        text = _MACROS.get(self.expr.strip().lower(), self.expr)
        parts = text.split()
        if len(parts) != 5:
            raise ValueError(
                f"cron {self.expr!r}: needs 5 fields (minute hour day-of-month month "
                f"day-of-week) or a macro such as @daily, got {len(parts)}"
            )
        fields = [_field(part, n, self.expr) for n, part in enumerate(parts)]
        for name, value in zip(
            ("minutes", "hours", "days", "months", "weekdays"), fields, strict=True
        ):
            object.__setattr__(self, name, value)
        object.__setattr__(self, "any_day", parts[2] == "*")
        object.__setattr__(self, "any_weekday", parts[4] == "*")
        if self.any_weekday and not any(
            day <= _MONTH_DAYS[month - 1] for month in self.months for day in self.days
        ):
            raise ValueError(f"cron {self.expr!r}: no month of it has any of its days")

    def _day_matches(self, at: datetime.datetime) -> bool:
        day = at.day in self.days
        weekday = (at.isoweekday() % 7) in self.weekdays
        if self.any_day or self.any_weekday:
            return day and weekday
        return day or weekday

    def next_after(self, at: float) -> float:
        """The first tick strictly after ``at`` (seconds since the epoch)."""
        now = datetime.datetime.fromtimestamp(at, _UTC).replace(second=0, microsecond=0)
        now += datetime.timedelta(minutes=1)
        for _ in range(_MAX_STEPS):
            if now.month not in self.months:
                year, month = (now.year + 1, 1) if now.month == 12 else (now.year, now.month + 1)
                now = now.replace(year=year, month=month, day=1, hour=0, minute=0)
            elif not self._day_matches(now):
                now = now.replace(hour=0, minute=0) + datetime.timedelta(days=1)
            elif now.hour not in self.hours:
                now = now.replace(minute=0) + datetime.timedelta(hours=1)
            elif now.minute not in self.minutes:
                now += datetime.timedelta(minutes=1)
            else:
                return now.timestamp()
        raise ValueError(f"cron {self.expr!r}: no tick found within the search bound")

    def latest_at(self, at: float) -> float | None:
        """The last tick at or before ``at`` (seconds since the epoch); None if the search finds none."""
        now = datetime.datetime.fromtimestamp(at, _UTC).replace(second=0, microsecond=0)
        for _ in range(_MAX_STEPS):
            if now.month not in self.months:
                now = now.replace(day=1, hour=0, minute=0) - datetime.timedelta(minutes=1)
            elif not self._day_matches(now):
                now = now.replace(hour=0, minute=0) - datetime.timedelta(minutes=1)
            elif now.hour not in self.hours:
                now = now.replace(minute=0) - datetime.timedelta(minutes=1)
            elif now.minute not in self.minutes:
                now -= datetime.timedelta(minutes=1)
            else:
                return now.timestamp()
        return None
