"""stop_event: SIGTERM sets the event instead of killing the process."""

from __future__ import annotations

import asyncio
import os
import signal

from gpualloc.runtime import signals


async def test_sigterm_sets_the_stop_event_and_removes_the_handlers() -> None:
    event = signals.stop_event()
    loop = asyncio.get_running_loop()
    try:
        assert not event.is_set()
        os.kill(os.getpid(), signal.SIGTERM)
        await asyncio.wait_for(event.wait(), 5)
        assert event.is_set()
        # The handler is gone after the first signal: a second one would act as without it.
        assert not loop.remove_signal_handler(signal.SIGTERM)
    finally:
        for sig in signals.SIGNALS:
            loop.remove_signal_handler(sig)
