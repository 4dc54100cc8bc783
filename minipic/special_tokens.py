"""Moved to ``span_contract.special_tokens`` (the client-engine contract sits below the app); this alias keeps
old imports working while they are updated."""

import sys

from span_contract import special_tokens as _moved

sys.modules[__name__] = _moved
