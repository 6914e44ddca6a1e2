"""Test kit for strategy authors: the suites the built-in plugins pass, importable by plugins.

`pytest --infer-kit SLOT=NAME` (the pytest plugin in `pytest_plugin`) runs them against an
installed strategy; `attention`, `attention_kit`, `sampling`, `allocator`, `decoder`, `model`,
`model_layers` and `constraints` hold the cases, oracles and checks; `json_schemas` makes seeded random
JSON schemas, each with a bound on its documents' size, for structured-output tests.
"""
