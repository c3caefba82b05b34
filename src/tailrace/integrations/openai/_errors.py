"""What a failed generation raises: :class:`CompletionError`, retryable or not.

``retryable`` marks what another attempt may fix (HTTP 429 and 5xx, timeouts,
dropped connections, a stream the server cut); ``retry_after`` carries the
server's ``Retry-After`` in seconds. The node's ``RetryPolicy`` retries it
(``retry_on=(CompletionError,)``), and the client keeps the endpoint that
asked for the wait out of use until then.
"""

from __future__ import annotations

import datetime
import email.utils


class CompletionError(RuntimeError):
    """The endpoint failed or answered something that is not a completion.

    Args:
        message: What went wrong, naming the model.
        status: The HTTP status, when there was a response.
        retryable: True for failures another attempt may fix (429, 5xx,
            timeouts, transport errors, a cut stream).
        retry_after: Seconds the server asked to wait (``Retry-After``), if any.
    """

    def __init__(
        self,
        message: str,
        *,
        status: int | None = None,
        retryable: bool = False,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.retryable = retryable
        self.retry_after = retry_after


def retry_after_seconds(value: str | None, now: datetime.datetime | None = None) -> float | None:
    """Seconds a ``Retry-After`` header asks to wait (delta-seconds or an HTTP date), or None.

    Args:
        value: The header's value.
        now: The current time, for an HTTP date (default: now, UTC).

    >>> retry_after_seconds("7"), retry_after_seconds("soon")
    (7.0, None)
    """
    if value is None:
        return None
    text = value.strip()
    if text.isdigit():
        return float(text)
    try:
        when = email.utils.parsedate_to_datetime(text)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=datetime.UTC)
    now = now or datetime.datetime.now(datetime.UTC)
    return max(0.0, (when - now).total_seconds())
