"""``python -m tailrace.integrations.openai``: a :class:`BatchingServer` in a process of its own."""

from ._server import main

main()
