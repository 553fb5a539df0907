"""Why fastserve turns numpy's huge-page advice off before it loads a model (issue 11).

On Linux numpy advises transparent huge pages (madvise MADV_HUGEPAGE) for every array of 4 MiB or
more. glibc serves many such arrays from its brk heap once its mmap threshold has risen (it rises to
the size of each large block freed, up to 32 MiB: loading a model frees many), so the advice lands on
the heap, and it stays there after the array is freed. The small allocations of every request (its
buffers, strings, parser state) later reuse that part of the heap, and each 4 kB page they touch
brings in a whole 2 MiB page (khugepaged fills in more in the background). RSS then grows with the
requests served and never comes back, while malloc and Python hold no more memory than before:
measured with bench/bench_killed_streams.py, +1.5 / +7.7 / +34.6 MB over three rounds of 1,200
killed streams with the advice, +6.0 / +0.6 / +0.4 MB without it (and +0.0 / +0.0 / +0.0 once the
KV cache is also made resident whole at start: backends/cpu/kv_cache.py).

An explicit NUMPY_MADVISE_HUGEPAGE in the environment is the user's choice and is left alone.
"""
from __future__ import annotations

import os


def no_huge_page_advice() -> bool:
    """Stop numpy advising huge pages for the arrays allocated from now on (idempotent).
    Returns True when the advice is off (it may have been off already)."""
    if "NUMPY_MADVISE_HUGEPAGE" in os.environ:
        return os.environ["NUMPY_MADVISE_HUGEPAGE"] == "0"
    try:
        from numpy._core.multiarray import _set_madvise_hugepage
    except ImportError:                 # numpy < 2
        try:
            from numpy.core.multiarray import _set_madvise_hugepage
        except ImportError:
            return False
    _set_madvise_hugepage(False)
    return True
