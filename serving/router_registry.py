"""The span routers living in this process, by deployment name.

Ray builds a request router inside each deployment handle and pickles the router's module by
value, so the ingress cannot reach it through that module's globals; routers register here (an
ordinary, imported-by-reference module) and ``GET /minipic/cluster`` reads their state.
"""

from __future__ import annotations

import weakref
from typing import Any

_ROUTERS: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()


def register(deployment: str, router: Any) -> None:
    _ROUTERS[deployment] = router


def lookup(deployment: str) -> Any | None:
    return _ROUTERS.get(deployment)
