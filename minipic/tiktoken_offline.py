"""Moved to ``span_contract.tiktoken_offline`` (the client-engine contract sits below the app); this alias keeps
old imports working while they are updated."""

import sys

from span_contract import tiktoken_offline as _moved

sys.modules[__name__] = _moved
