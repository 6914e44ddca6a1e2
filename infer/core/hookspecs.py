"""Moved to `infer.api.hookspecs`: this old name is an alias that warns, kept for the plugins written
against it; import from `infer.api` (docs/plugins.md)."""

import sys
import warnings

from infer.api import hookspecs as _moved

warnings.warn(
    "infer.core.hookspecs moved to infer.api.hookspecs: import from there (the old name is an alias, to be removed)",
    DeprecationWarning,
    stacklevel=2,
)
sys.modules[__name__] = _moved
