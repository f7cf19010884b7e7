"""Reply bytes waiting for clients that have not read them, over all connections.

The loop's `_run` runs a session's next command only once its replies are
out while the total is past session.UNSENT_BUDGET; the loop keeps the total
(`MutationLoop.note_unsent`) and tells `Unsent` each change, which says so
in the log once a minute, and, once a flood of such replies is gone, gives
the memory back to the system: freed replies otherwise stay in the C
allocator's heap (400 clients that never read left the server 138 MB
resident after they hung up, where it had started at 15 MB).
"""

from __future__ import annotations

import logging

from smallstalk.server.session import UNSENT_BUDGET

log = logging.getLogger("smallstalk.server.unsent")

# A total that once passed this is worth a trim when it is back to nothing
# (a trim walks the whole heap: not after every slow client).
TRIM_FROM = 16 << 20
PASSED = ("more than %d MiB of replies wait for clients that do not read them: until "
          "they are under it, each connection runs its next command only once its "
          "replies are out (logged once a minute)")


class Unsent:
    """The high-water mark of the unsent total since the last trim, and when
    the budget was last said to be passed."""

    __slots__ = ("peak", "logged_at")

    def __init__(self) -> None:
        self.peak = 0
        self.logged_at = -1e9

    def changed(self, before: int, after: int, now: float) -> None:
        """The total went from `before` to `after` bytes (`now`: trio's clock)."""
        if after > self.peak:
            self.peak = after
            if before <= UNSENT_BUDGET < after and now - self.logged_at >= 60.0:
                self.logged_at = now
                log.warning(PASSED, UNSENT_BUDGET >> 20)
        elif after == 0 and self.peak >= TRIM_FROM:
            self.peak = 0
            give_back_freed_memory()


def give_back_freed_memory() -> None:
    """Return the C allocator's free pages to the system (glibc's
    malloc_trim; elsewhere nothing: the memory is reused, not returned)."""
    import ctypes  # only here: not on the start-up path

    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
    if trim is not None:
        trim(0)
