"""What the process costs so far: resident memory and seconds since it started (for the start-up line)."""
from __future__ import annotations

import os
import sys
import time

_IMPORTED = time.monotonic()        # the fallback origin where /proc is not there


def rss_bytes() -> int:
    """Resident memory now (Linux: /proc/self/statm); elsewhere the peak so far (getrusage), or 0."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError, AttributeError):
        pass
    try:
        import resource
    except ImportError:             # Windows
        return 0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024      # macOS: bytes; Linux/BSD: KiB


def seconds_since_start() -> float:
    """Seconds since this process started (Linux: /proc, 10 ms steps), else since fastserve was imported."""
    try:
        with open("/proc/self/stat") as f:
            started_ticks = int(f.read().rsplit(")", 1)[1].split()[19])   # field 22, after the (comm)
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - started_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError, AttributeError):
        return time.monotonic() - _IMPORTED
