"""Hypothesis profiles for the fuzz suite: "ci" (default) and "soak" (10,000 examples per test).

Registered here, before pytest's hypothesis plugin reads ``--hypothesis-profile``.
Every rank must draw the same examples, hence derandomize and no database.
"""

from hypothesis import HealthCheck, settings

_COMMON = {"derandomize": True, "database": None, "deadline": None, "suppress_health_check": list(HealthCheck)}
settings.register_profile("ci", max_examples=150, **_COMMON)
settings.register_profile("soak", max_examples=10_000, **_COMMON)
settings.load_profile("ci")
