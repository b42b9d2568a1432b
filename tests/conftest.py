"""Hypothesis profiles: CI replays the same examples every run, so a landing is never decided
by the luck of a random draw; runs elsewhere explore new ones (and keep what fails in
.hypothesis/ to replay it)."""

from __future__ import annotations

import os

from hypothesis import settings

settings.register_profile("ci", derandomize=True, deadline=None)
if os.environ.get("CI") == "true":
    settings.load_profile("ci")
