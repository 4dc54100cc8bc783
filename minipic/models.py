"""Moved to ``span_contract.models`` (the client-engine contract sits below the app); this alias keeps
old imports working while they are updated."""

import sys

from span_contract import models as _moved

sys.modules[__name__] = _moved
