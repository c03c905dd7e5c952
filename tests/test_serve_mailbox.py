"""gptj.serve.completions.Mailbox: the engine thread's calls reach the event loop in order, those that
arrive together with one wake-up, and none is kept once the loop is closed."""

from __future__ import annotations

import asyncio
import threading

from gptj.serve.completions import Mailbox


def test_calls_posted_while_the_loop_is_busy_run_in_order_after_one_wakeup():
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        busy, release = threading.Event(), threading.Event()
        loop.call_soon_threadsafe(lambda: (busy.set(), release.wait(30)))  # the loop is held in a callback
        assert busy.wait(30)
        box, seen = Mailbox.for_loop(loop), []
        assert Mailbox.for_loop(loop) is box  # one per loop, shared by every request on it
        for i in range(100):  # a step's tokens for 100 streams, from this (the engine's) thread
            box.post(seen.append, i)
        assert box.wakeups == 1 and seen == []
        release.set()
        done = threading.Event()
        box.post(done.set)
        assert done.wait(30)
        assert seen == list(range(100))
        # a call that fails does not strand those after it; the next post wakes the loop again
        after = threading.Event()
        box.post(lambda: 1 / 0)
        box.post(after.set)
        assert after.wait(30) and box.wakeups >= 2
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)
        loop.close()


def test_posts_to_a_closed_loop_are_dropped_not_kept():
    loop = asyncio.new_event_loop()
    loop.close()
    box = Mailbox(loop)
    for i in range(10):
        box.post(print, i)  # the server is gone: nothing raises in the engine's thread
    assert not box.calls and not box.scheduled and box.wakeups == 10
