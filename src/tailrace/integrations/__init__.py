"""Integrations with other runtimes; each is an optional extra imported only by its users.

- :mod:`tailrace.integrations.langgraph`: human-in-the-loop for real LangGraph
  graphs (``pip install 'tailrace[langgraph]'``).
"""
