"""The conformance suites `pytest --infer-kit SLOT=NAME` collects (kit_<slot>.py), one per slot."""
