"""tokenizer_proc/throttled_log.py: a repeated log line, a few a second at most."""

import logging

from mlxd.tokenizer_proc.throttled_log import ThrottledLog


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_lines_over_the_rate_are_counted_and_reported_with_the_next_line(caplog):
    clock = Clock()
    throttled = ThrottledLog(logging.getLogger("test.throttled"), logging.ERROR, 3, clock)
    with caplog.at_level(logging.ERROR, "test.throttled"):
        for i in range(1000):
            throttled("bad frame %d", i)
        assert [r.getMessage() for r in caplog.records] == [
            "bad frame 0", "bad frame 1", "bad frame 2"]
        clock.now += 1.0
        throttled("bad frame %d", 1000)
    assert caplog.records[-1].getMessage() == "bad frame 1000 (997 similar lines left out)"
    assert len(caplog.records) == 4
