"""Moved to ``span_contract.engine_config`` (the client-engine contract sits below the app); this alias keeps
old imports working while they are updated."""

import sys

from span_contract import engine_config as _moved

sys.modules[__name__] = _moved
