"""Graceful stop: an event set by the first SIGINT or SIGTERM."""

from __future__ import annotations

import asyncio
import logging
import signal

log = logging.getLogger(__name__)

SIGNALS = (signal.SIGINT, signal.SIGTERM)


def stop_event() -> asyncio.Event:
    """An event set on SIGINT/SIGTERM, with the handlers installed on the running loop.

    The first signal sets the event and removes the handlers, so a second one
    acts as it would without them (SIGINT raises KeyboardInterrupt, SIGTERM
    ends the process): a stuck shutdown can still be cut short.
    """
    loop = asyncio.get_running_loop()
    event = asyncio.Event()

    def on_signal(signum: signal.Signals) -> None:
        log.info("stopping", extra={"signal": signum.name})
        event.set()
        for sig in SIGNALS:
            loop.remove_signal_handler(sig)

    for sig in SIGNALS:
        loop.add_signal_handler(sig, on_signal, sig)
    return event
