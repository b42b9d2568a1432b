"""hangwatch: tells a deadlocked, stalled, idle or progressing inference server apart."""

__version__ = "0.1.0"
