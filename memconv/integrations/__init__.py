"""Integrations with other libraries; each depends on the core, never the reverse.

Each plugs into its peer's own extension point and imports the peer only when one
of its functions is called: :mod:`memconv.integrations.backpack`,
:mod:`memconv.integrations.opacus`.
"""
