"""Moved to ``span_contract.span_config`` (the client-engine contract sits below the app); this alias keeps
old imports working while they are updated."""

import sys

from span_contract import span_config as _moved

sys.modules[__name__] = _moved
