"""Moved to `infer.api.errors`: this old name is an alias that warns, kept for the plugins written
against it; import from `infer.api` (docs/plugins.md)."""

import sys
import warnings

from infer.api import errors as _moved

warnings.warn(
    "infer.core.errors moved to infer.api.errors: import from there (the old name is an alias, to be removed)",
    DeprecationWarning,
    stacklevel=2,
)
sys.modules[__name__] = _moved
