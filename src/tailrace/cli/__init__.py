"""The ``tailrace`` command. Needs the ``cli`` extra (typer, rich)."""

from __future__ import annotations

import sys


def main() -> None:
    """Entry point of the ``tailrace`` console script."""
    try:
        from ._app import app  # the cli extra (typer, rich) is optional
    except ImportError as exc:  # pragma: no cover - exercised only without the extra
        sys.stderr.write(
            f"tailrace: the command line needs the 'cli' extra ({exc.name} is missing):\n"
            "    pip install 'tailrace[cli]'\n"
        )
        raise SystemExit(2) from exc
    app()
