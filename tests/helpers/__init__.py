"""Test helpers shared by every test package: assertions, oracles, invariants, generators.

Import them as ``from helpers.assertions import assert_close`` (pytest puts ``tests/`` on the
path). Nothing here is imported by conftest.
"""
