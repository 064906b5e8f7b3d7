"""A log line that may repeat without limit (one per bad frame a client sends), written
at most a few times a second with a count of the ones left out."""

import logging
import time


class ThrottledLog:
    """At most `per_second` lines a second through `logger` at `level`; the next line
    written after some were left out says how many."""

    def __init__(self, logger: logging.Logger, level: int, per_second: int = 5,
                 clock=time.monotonic):
        self.logger, self.level, self.per_second, self.clock = logger, level, per_second, clock
        self._window_start = float("-inf")
        self._written = 0      # lines in the current one-second window
        self.suppressed = 0    # left out since the last line written

    def __call__(self, msg: str, *args) -> None:
        now = self.clock()
        if now - self._window_start >= 1.0:
            self._window_start, self._written = now, 0
        if self._written >= self.per_second:
            self.suppressed += 1
            return
        self._written += 1
        if self.suppressed:
            msg += f" ({self.suppressed} similar lines left out)"
            self.suppressed = 0
        self.logger.log(self.level, msg, *args)
