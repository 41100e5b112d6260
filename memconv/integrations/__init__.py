"""Integrations with other libraries; each depends on the core, never the reverse.

Importing this package registers the integrations' listeners with the core; none
of them imports its library until the user has imported it.
"""

from . import backpack  # noqa: F401
