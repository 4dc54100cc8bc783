"""The span routers living in this process, by application name (one engine deployment each).

Ray builds a request router inside each deployment handle and pickles the router's module by
value, so the ingress cannot reach it through that module's globals; routers register here (an
ordinary, imported-by-reference module) and ``GET /minipic/cluster`` reads their state.
"""

from __future__ import annotations

import weakref
from typing import Any

_ROUTERS: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()


def register(app: str, router: Any) -> None:
    _ROUTERS[app] = router


def lookup(app: str) -> Any | None:
    return _ROUTERS.get(app)
