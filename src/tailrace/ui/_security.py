"""The dashboard's guards: the token for state changes, headers, JSON safe inside a page.

Reading needs no token; anything that changes state (answering, resuming) is
a POST that carries the token in a form field or the ``X-Tailrace-Token``
header, compared in constant time. A valid token also sets an HttpOnly,
SameSite=Strict cookie, so pages served to that browser fill the field in
(a cross-site page can neither read the field nor send the cookie). The
cookie alone never authorises a change: that is the CSRF guard.
"""

from __future__ import annotations

import json
import secrets
from typing import Any

#: Form field and header that carry the token on a state change.
TOKEN_FIELD = "token"
TOKEN_HEADER = "x-tailrace-token"
#: Cookie that lets pages fill the token field in for a browser that proved it.
TOKEN_COOKIE = "tailrace_token"

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
    return secrets.compare_digest(expected.encode(), given.encode())


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
