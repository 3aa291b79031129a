"""`gradaccum.audit` on JAX: the cases every backend shares (tests/audit_cases.py)."""

from __future__ import annotations

from audit_cases import *  # noqa: F403 (the shared test cases)
