"""Helpers shared by the tests (importable as `support.*` with tests/ on sys.path)."""
