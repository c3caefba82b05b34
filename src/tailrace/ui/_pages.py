"""Rendering: one Jinja2 environment with autoescape on for every template.

Stored text reaches a page only through these templates, so it is always
escaped (CONVENTIONS 15); JSON embedded in a page goes through
:func:`~tailrace.ui._security.script_json`. Responses are
:class:`~starlette.responses.HTMLResponse` built from templates only.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jinja2 import Environment, FileSystemLoader, StrictUndefined
from markupsafe import Markup
from starlette.responses import HTMLResponse

from . import _links
from ._format import shorten
from ._security import script_json

TEMPLATES = Path(__file__).parent / "templates"


@dataclass(frozen=True, slots=True)
class Auth:
    """What the viewer may do: change state at all, and the token to fill forms with.

    ``token`` is set only for a browser that proved it holds the token
    (its cookie); others type it into the form.
    """

    can_change: bool
    token: str | None


class Pages:
    """The dashboard's templates and the values every page shows.

    Args:
        location: the store, as the header shows it.
        read_only: whether the dashboard refuses state changes.
    """

    def __init__(self, *, location: str, read_only: bool) -> None:
        self.env = Environment(
            loader=FileSystemLoader(TEMPLATES),
            autoescape=True,  # every template, whatever its name
            undefined=StrictUndefined,
            trim_blocks=True,
            lstrip_blocks=True,
        )
        self.env.filters["shorten"] = shorten
        self.env.filters["script_json"] = lambda value: Markup(script_json(value))
        self.env.globals.update(
            {name: getattr(_links, name) for name in _links.__all__}
            | {"location": location, "read_only": read_only}
        )

    def page(self, name: str, *, status_code: int = 200, **context: Any) -> HTMLResponse:
        """Render the template ``name`` as a response."""
        context.setdefault("open_questions", 0)
        context.setdefault("section", "")
        context.setdefault("locked", False)  # a stranger beyond loopback: no store name, no nav
        html = self.env.get_template(name).render(**context)
        return HTMLResponse(html, status_code=status_code)

    def part(self, template: str, macro: str, *args: Any) -> str:
        """Render one macro of ``template`` (a fragment the live stream sends)."""
        module = self.env.get_template(template).module
        return str(getattr(module, macro)(*args))
