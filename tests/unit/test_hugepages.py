"""load_model turns numpy's huge-page advice off (fastserve/models/hugepages.py), unless the user chose."""
import subprocess
import sys

CHECK = """
import numpy, fastserve.models.hugepages as h
try:
    from numpy._core.multiarray import _get_madvise_hugepage
except ImportError:     # numpy < 2
    from numpy.core.multiarray import _get_madvise_hugepage
print(h.no_huge_page_advice(), _get_madvise_hugepage())
"""


def _run(env_value):
    import os
    env = {k: v for k, v in os.environ.items() if k != "NUMPY_MADVISE_HUGEPAGE"}
    if env_value is not None:
        env["NUMPY_MADVISE_HUGEPAGE"] = env_value
    out = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, env=env, check=True)
    return out.stdout.split()


def test_advice_off_by_default_and_the_users_choice_kept():
    assert _run(None) == ["True", "False"]
    assert _run("1") == ["False", "True"]       # asked for: left on
    assert _run("0") == ["True", "False"]
