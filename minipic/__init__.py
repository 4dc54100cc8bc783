"""minipic: the app (CLI, serve, demo, bench) on top of the span-aware engine layers.

Importing the package imports ``minipic.engine_logs`` (stdlib only, cheap) on purpose: vLLM's
engine processes are spawned, re-import the parent's ``__main__`` — ``minipic.cli`` or an example
script, both of which import this package — and so install the known-noise log filter that
``quiet_engine_logs`` asked for before they import vLLM (see ``minipic/engine_logs.py``).
"""

from minipic import engine_logs as _engine_logs  # noqa: F401  (see the docstring)
