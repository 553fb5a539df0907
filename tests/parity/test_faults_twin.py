"""fastserve._faults as a release build has it, and its pure-Python twin: the same names, and every
check does nothing (the fault build, FASTSERVE_TEST_FAULTS=1, is tests/faults/'s)."""
import pytest

import fastserve._faults as cfaults
import fastserve.ref.faults as rfaults


def test_same_public_names():
    assert {n for n in dir(cfaults) if not n.startswith("_")} == {n for n in dir(rfaults) if not n.startswith("_")}


@pytest.mark.parametrize("impl", [cfaults, rfaults], ids=["cython", "ref"])
def test_a_release_build_checks_nothing(impl):
    assert impl.ENABLED is False
    assert (impl.check_copy(), impl.check_fill(), impl.check_step()) == (None, None, None)
    assert impl.settings() == {}
