"""Moved to `infer.api.slots`: this old name is an alias that warns, kept for the plugins written
against it; import from `infer.api` (docs/plugins.md)."""

import sys
import warnings

from infer.api import slots as _moved

warnings.warn(
    "infer.core.slots moved to infer.api.slots: import from there (the old name is an alias, to be removed)",
    DeprecationWarning,
    stacklevel=2,
)
sys.modules[__name__] = _moved
