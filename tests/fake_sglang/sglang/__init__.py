"""A stand-in `sglang` package for tests (on PYTHONPATH only in tests that ask for it)."""
