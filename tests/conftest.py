"""Hypothesis profiles: ``dev`` (the default) draws new examples on every run, so the
property tests keep looking for bugs; ``ci`` (``HYPOTHESIS_PROFILE=ci``, set by ``.ci/run``)
derandomizes them, so the gate a submission must pass does not fail at random. A failure
found in ``dev`` prints its reproduction blob; fix it and pin it with ``@example``."""

from __future__ import annotations

import os

from hypothesis import settings

settings.register_profile("dev", print_blob=True)
settings.register_profile("ci", derandomize=True, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))
