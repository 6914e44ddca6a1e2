"""Test kit for strategy authors: the suites the built-in plugins pass, importable by plugins."""
