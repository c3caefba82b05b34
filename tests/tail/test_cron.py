"""Cron expressions (W4): parsed with the standard library, stepped against a minute-by-minute oracle."""

from __future__ import annotations

import datetime as dt

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tailrace.tail import Cron

UTC = dt.UTC
#: Minutes the oracle walks at most (two weeks).
WINDOW = 14 * 24 * 60


def at(*parts: int) -> float:
    return dt.datetime(*parts, tzinfo=UTC).timestamp()


def matches(cron: Cron, minute: dt.datetime) -> bool:
    """The oracle: a minute is a tick when every field matches (days: either, when both restricted)."""
    day, weekday = minute.day in cron.days, minute.isoweekday() % 7 in cron.weekdays
    days = (day and weekday) if (cron.any_day or cron.any_weekday) else (day or weekday)
    return (
        minute.minute in cron.minutes and minute.hour in cron.hours
        and minute.month in cron.months and days
    )  # fmt: skip


def field(low: int, high: int) -> st.SearchStrategy[str]:
    value = st.integers(low, high)
    one = st.one_of(
        st.just("*"),
        value.map(str),
        st.tuples(value, value).map(lambda ab: f"{min(ab)}-{max(ab)}"),
        st.integers(1, 20).map(lambda n: f"*/{n}"),
        st.tuples(value, st.integers(1, 9)).map(lambda an: f"{an[0]}/{an[1]}"),
    )
    return st.lists(one, min_size=1, max_size=3).map(",".join)


EXPRESSIONS = st.tuples(field(0, 59), field(0, 23), field(1, 31), field(1, 12), field(0, 7)).map(
    " ".join
)


def parsed(expr: str) -> Cron | None:
    try:
        return Cron(expr)
    except ValueError:
        return None  # e.g. "30 2" days only: refused, and said so (tested below)


@settings(max_examples=60, deadline=None)
@given(EXPRESSIONS, st.integers(0, 4_000_000_000))
def test_next_and_latest_agree_with_the_minute_oracle(expr: str, seconds: int) -> None:
    cron = parsed(expr)
    if cron is None:
        return
    start = dt.datetime.fromtimestamp(seconds, UTC).replace(second=0)
    forward = next(
        (start + dt.timedelta(minutes=n) for n in range(1, WINDOW) if matches(
            cron, start + dt.timedelta(minutes=n))),
        None,
    )  # fmt: skip
    found = cron.next_after(float(seconds))
    if forward is not None:
        assert found == forward.timestamp(), expr
    else:
        assert found > (start + dt.timedelta(minutes=WINDOW - 1)).timestamp(), expr
    back = next(
        (start - dt.timedelta(minutes=n) for n in range(WINDOW) if matches(
            cron, start - dt.timedelta(minutes=n))),
        None,
    )  # fmt: skip
    latest = cron.latest_at(float(seconds))
    if back is not None:
        assert latest == back.timestamp(), expr
    else:
        assert latest is None or latest < (start - dt.timedelta(minutes=WINDOW - 1)).timestamp()


def test_macros_names_and_sunday_as_seven() -> None:
    assert Cron("@daily").next_after(at(2026, 12, 2, 10, 0)) == at(2026, 12, 3, 0, 0)
    assert Cron("@hourly").latest_at(at(2026, 12, 2, 10, 59, 59)) == at(2026, 12, 2, 10, 0)
    assert Cron("0 12 * * 7").next_after(at(2026, 12, 2)) == at(2026, 12, 6, 12, 0)  # a Sunday
    assert Cron("0 0 1 jan *").weekdays == frozenset(range(7))
    assert Cron("0 0 29 feb *").next_after(at(2026, 3, 1)) == at(2028, 2, 29)


def test_day_of_month_or_day_of_week_when_both_are_restricted() -> None:
    cron = Cron("0 0 13 * fri")  # the 13th, and every Friday
    ticks = []
    t = at(2026, 11, 30)
    for _ in range(4):
        t = cron.next_after(t)
        ticks.append(dt.datetime.fromtimestamp(t, UTC).date().isoformat())
    assert ticks == ["2026-12-04", "2026-12-11", "2026-12-13", "2026-12-18"]


@pytest.mark.parametrize(
    ("expr", "says"),
    [
        ("* * * *", "needs 5 fields"),
        ("60 * * * *", "minute 60 is outside 0..59"),
        ("* 5-2 * * *", "hour range '5-2' runs backwards"),
        ("*/0 * * * *", "minute step '0'"),
        ("* * * foo *", "month 'foo' is not a number or a name"),
        ("0 0 30 2 *", "no month of it has any of its days"),
        ("0 0 31 4,6 *", "no month of it has any of its days"),
    ],
)
def test_a_bad_expression_is_refused_naming_the_field(expr: str, says: str) -> None:
    with pytest.raises(ValueError, match=says.replace("*", r"\*")):
        Cron(expr)
