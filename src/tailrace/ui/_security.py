"""The dashboard's guards: the token for state changes, headers, JSON safe inside a page.

Anything that changes state (answering, resuming, cancelling) is a POST that
carries the token in a form field or the ``X-Tailrace-Token`` header,
compared in constant time. The login page (a form POST of the token, never a
``?token=`` address that history and proxy logs keep) sets an HttpOnly,
SameSite=Strict cookie, so pages served to that browser fill the field in (a
cross-site page can neither read the field nor send the cookie). The cookie
alone never authorises a change: that is the CSRF guard.

On loopback reading needs nothing. A dashboard that listens beyond loopback
needs the cookie to read too, pages and live streams alike; that is decided
by where it listens, never by the ``Host`` header a request claims.
"""

from __future__ import annotations

import hashlib
import json
import secrets
from typing import Any

#: Form field and header that carry the token on a state change.
TOKEN_FIELD = "token"
TOKEN_HEADER = "x-tailrace-token"
#: Cookie that lets pages fill the token field in for a browser that proved it.
TOKEN_COOKIE = "tailrace_token"
#: Where a browser proves it holds the token (a form POST).
LOGIN_PATH = "/login"

#: Sent with every response. The strict CSP (no inline script or style) is a
#: second line behind autoescaping: injected markup could not run anyway.
SECURITY_HEADERS = {
    "content-security-policy": (
        "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'self'; "
        "frame-ancestors 'none'"
    ),
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    "x-frame-options": "DENY",
}

#: Hosts a dashboard bound to a loopback address answers to (DNS-rebinding guard).
LOOPBACK_HOSTS = ("127.0.0.1", "localhost")

_SCRIPT_UNSAFE = {
    "<": "\\u003c",
    ">": "\\u003e",
    "&": "\\u0026",
    "'": "\\u0027",
    "\u2028": "\\u2028",
    "\u2029": "\\u2029",
}


def new_token() -> str:
    """A fresh random token (32 URL-safe characters)."""
    return secrets.token_urlsafe(24)


def token_matches(expected: str, given: str | None) -> bool:
    """Whether ``given`` is ``expected``, compared in constant time."""
    if not given:
        return False
    # Digests of equal length: the comparison time says nothing of the token's length either.
    want = hashlib.sha256(expected.encode("utf-8", "surrogatepass")).digest()
    got = hashlib.sha256(given.encode("utf-8", "surrogatepass")).digest()
    return secrets.compare_digest(want, got)


def script_json(value: Any) -> str:
    """``value`` as JSON that is safe inside ``<script type="application/json">``.

    ``<``, ``>``, ``&``, ``'`` and the JavaScript line separators are escaped,
    so stored text such as ``</script><script>...`` cannot end the element.

    >>> script_json({"prompt": "</script><b>"})
    '{"prompt": "\\\\u003c/script\\\\u003e\\\\u003cb\\\\u003e"}'
    """
    text = json.dumps(value, ensure_ascii=False)
    for char, escaped in _SCRIPT_UNSAFE.items():
        text = text.replace(char, escaped)
    return text


def is_loopback(host: str) -> bool:
    """Whether the address ``host`` the dashboard binds is on this machine only."""
    return host in LOOPBACK_HOSTS or host.startswith("127.") or host == "::1"


def local_path(target: str | None, default: str = "/runs") -> str:
    """``target`` if it is a path on this site, else ``default`` (never another host).

    >>> local_path("/runs/a?x=1"), local_path("//evil.example/x"), local_path("https://e.x/")
    ('/runs/a?x=1', '/runs', '/runs')
    """
    if not target or not target.startswith("/") or target.startswith("//"):
        return default
    if "\\" in target or any(ord(c) < 0x20 for c in target):
        return default
    return target
