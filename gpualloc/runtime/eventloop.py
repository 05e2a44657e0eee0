"""Running a component's main coroutine: on uvloop's event loop.

Every component spends most of its CPU in the event loop and its TLS and socket
transports: the webhook serving admission reviews, the controller and the agent
talking to the API server. uvloop implements those in Cython over libuv; with it
a request costs less CPU than on the standard loop's pure-Python TLS transport
(BENCHMARKS.md, "Webhook under vegeta"). The asyncio API is the same, so code
and tests do not know which loop runs them.
"""

from __future__ import annotations

from collections.abc import Coroutine
from typing import Any, TypeVar

import uvloop

T = TypeVar("T")


def run(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(main)``, on a uvloop event loop."""
    return uvloop.run(main)
