"""Open a GGUF file (memory-mapped) and read its metadata and tensor table.

Every way a file can be unusable (missing, not GGUF, truncated) becomes a
ModelLoadError that names the file and the problem.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import ModelLoadError

GGUF_MAGIC = b"GGUF"


@dataclass(frozen=True)
class TensorEntry:
    name: str
    type_name: str          # e.g. "Q4_1", "F32" (gguf.GGMLQuantizationType name)
    type_id: int
    shape: tuple[int, ...]  # numpy order: rows first (GGUF's ne reversed)
    data: np.ndarray        # raw bytes or elements, memory-mapped


class GGUFFile:
    """A GGUF file: `metadata` (key -> python value) and `tensors` (name -> TensorEntry)."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        _check_header(self.path)
        from gguf import GGUFReader

        try:
            reader = GGUFReader(self.path, "r")
        except Exception as exc:  # gguf raises ValueError, IndexError, struct errors ... on bad files
            raise ModelLoadError(f"{self.path}: not a readable GGUF file ({type(exc).__name__}: {exc}); "
                                 "the file may be truncated or corrupt: download it again") from exc
        self.metadata: dict[str, Any] = {}
        for key, field in reader.fields.items():
            if key.startswith("GGUF."):
                continue
            self.metadata[key] = field.contents()
        self.tensors: dict[str, TensorEntry] = {}
        size = os.path.getsize(self.path)
        for t in reader.tensors:
            end = int(t.data_offset) + int(t.n_bytes)
            if end > size:
                raise ModelLoadError(f"{self.path}: truncated: tensor {t.name} ends at byte {end} "
                                     f"but the file has {size} bytes; download it again")
            shape = tuple(int(x) for x in reversed(t.shape.tolist()))
            self.tensors[t.name] = TensorEntry(t.name, t.tensor_type.name, int(t.tensor_type),
                                               shape, t.data)

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", "<missing>"))


def _check_header(path: str) -> None:
    if not os.path.exists(path):
        raise ModelLoadError(f"{path}: no such file; pass a GGUF model path, or run `fastserve pull` "
                             "for the default model")
    if os.path.isdir(path):
        raise ModelLoadError(f"{path}: is a directory, not a GGUF file")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ModelLoadError(f"{path}: not a GGUF file (first bytes {magic!r}, expected {GGUF_MAGIC!r})")
