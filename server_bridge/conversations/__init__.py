"""Conversations: a user's runs with one agent on one device, and what a follow-up
request's model calls are given of the earlier ones (history.py: the turns; calls.py:
the hook the bridge's model calls go through). DESIGN.md "Conversations"."""

from .calls import History
from .history import DEFAULT_MAX_CHARS, DEFAULT_MAX_TURNS, Turns, turn_chars

__all__ = ["DEFAULT_MAX_CHARS", "DEFAULT_MAX_TURNS", "History", "Turns", "turn_chars"]
