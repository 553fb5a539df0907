"""The figures of the start-up line: resident memory now, and seconds since the process started."""
import mmap
import sys
import time

import numpy as np
import pytest

from fastserve.resources import rss_bytes, seconds_since_start


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="current RSS comes from /proc (elsewhere: the peak)")
def test_rss_is_the_memory_resident_now():
    # a fresh anonymous mapping, not the allocator's: in a process that ran other tests malloc may hand
    # back pages that are resident already (seen under pytest-xdist), and RSS would not move
    region = mmap.mmap(-1, 64 << 20)
    before = rss_bytes()
    touched = np.frombuffer(region, np.uint8)
    touched[:] = 1                              # 64 MiB, every page written
    grown = rss_bytes() - before
    assert touched[-1] == 1 and 60 << 20 < grown < 80 << 20
    del touched
    region.close()
    assert rss_bytes() < before + (16 << 20)    # unmapped: a current figure, not the peak


def test_seconds_since_start_counts_from_the_process_start():
    t = seconds_since_start()
    assert 0 < t < 24 * 3600
    time.sleep(0.15)
    assert 0.1 <= seconds_since_start() - t < 1.0
