"""RoPE's cos / sin tables of the CPU backend, filled as the positions are reached.

A table holds a row per position of a slot's context: at -c 32768 Gemma 3's two tables (global and local
layers, 128 angles each) are 64 MiB and ~0.35 s of cos / sin at start-up, at -c 131072 256 MiB and ~1.4 s,
whatever the prompts. RopeTables reserves the rows (untouched memory costs no RAM) and computes them in
blocks of FILL positions before the first step that reaches them: RAM and time follow the longest
sequence served, not -c. A row's values do not depend on when or in which block it is computed (every
operation is element-wise), so the numbers are those of rope_tables over the whole context.
"""
from __future__ import annotations

import numpy as np

from ..models.transformer import ModelConfig

FILL = 1024             # positions computed at once (one block: ~10 ms for Gemma 3's two tables)
YARN_BETA_FAST, YARN_BETA_SLOW = 32.0, 1.0      # llama.cpp's defaults (hparams.yarn_beta_fast / _slow)


def yarn(cfg: ModelConfig, base: float, scale: float) -> tuple[np.ndarray, float]:
    """YaRN as llama.cpp's rope_yarn runs it (ext_factor 1): per angle i, the factor on base^(-2i/rope_dim)
    (1/scale where the pair rotates slowly, 1 where it rotates fast, a ramp between the correction dims of
    beta_fast and beta_slow over n_ctx_orig), and the magnitude scale 1 + 0.1 ln(scale) (ggml's mscale; the
    attn_factor llama.cpp passes is get_mscale(scale) / (1 + 0.1 ln scale) = 1, times rope.scaling.attn_factor)."""
    half, f32 = cfg.rope_dim // 2, np.float32

    def corr_dim(rotations):    # ggml_rope_yarn_corr_dim, in float32 as ggml
        turns = f32(np.log(f32(cfg.n_ctx_orig / (rotations * 2 * np.pi))))
        return f32(cfg.rope_dim) * turns / f32(2 * np.log(f32(base)))
    low = max(0.0, float(np.floor(corr_dim(YARN_BETA_FAST))))
    high = min(cfg.rope_dim - 1.0, float(np.ceil(corr_dim(YARN_BETA_SLOW))))
    ramp = 1.0 - np.clip((np.arange(half, dtype=np.float64) - low) / max(0.001, high - low), 0.0, 1.0)
    mscale = f32(0.1) * f32(np.log(f32(scale))) + f32(1.0)
    # get_mscale(factor, 1) / (1 + 0.1 ln factor), as float32 rounds it; get_mscale is 1 for a factor <= 1
    attn = (mscale if scale > 1.0 else f32(1.0)) * (f32(1.0) / mscale)
    return (1.0 / scale) * (1.0 - ramp) + ramp, float(f32(attn * f32(cfg.rope_attn_factor)) * mscale)


def rope_tables(cfg: ModelConfig, n_pos: int, freq_factors: np.ndarray | None, local: bool = False,
                start: int = 0):
    """cos, sin [n_pos - start, rope_dim/2] in float32, rows of positions start .. n_pos - 1: angle
    (pos / scale) * base^(-2i/rope_dim) (/ factor i), the same for llama.cpp's adjacent-pair and NeoX
    layouts, both times cfg.rope_attn_factor (ggml's mscale). local: the local layers' table (their own
    base and scaling: cfg.rope_scale_local, 1 but for gpt-oss, as llama.cpp's rope_freq_scale_train_swa). YaRN
    (cfg.rope_yarn): the angles' factors and magnitude of yarn() instead of pos / scale."""
    half = cfg.rope_dim // 2
    base, scale = (cfg.rope_base_local, cfg.rope_scale_local) if local else (cfg.rope_base, cfg.rope_scale)
    inv_freq = base ** (-np.arange(half, dtype=np.float64) * 2.0 / cfg.rope_dim)
    if freq_factors is not None:
        inv_freq = inv_freq / freq_factors[:half].astype(np.float64)
    pos, mag = np.arange(start, n_pos, dtype=np.float64) / scale, cfg.rope_attn_factor
    if cfg.rope_yarn and scale != 1.0:
        factor, mag = yarn(cfg, base, scale)
        inv_freq, pos = inv_freq * factor, pos * scale
    theta = np.outer(pos, inv_freq)
    if mag != 1.0:
        return (np.cos(theta) * mag).astype(np.float32), (np.sin(theta) * mag).astype(np.float32)
    return np.cos(theta).astype(np.float32), np.sin(theta).astype(np.float32)


class RopeTables:
    """The global layers' (cos, sin) and the local layers' (cos_local, sin_local), each float32
    [n_pos, rope_dim/2] (the local ones the global arrays when no layer is local). Rows up to
    `filled` hold their values; cover(p) fills the rows up to position p first. The arrays never move
    (the C forward keeps their addresses)."""

    def __init__(self, cfg: ModelConfig, n_pos: int, freq_factors: np.ndarray | None):
        self.cfg, self.n_pos, self.freq_factors = cfg, n_pos, freq_factors
        self.has_local = any(cfg.local_layers)
        shape = (n_pos, cfg.rope_dim // 2)
        self.cos, self.sin = np.empty(shape, np.float32), np.empty(shape, np.float32)
        self.cos_local, self.sin_local = ((np.empty(shape, np.float32), np.empty(shape, np.float32))
                                          if self.has_local else (self.cos, self.sin))
        self.filled = 0
        self.cover(0)

    def cover(self, max_pos: int) -> None:
        """Rows 0 .. max_pos (and on to the end of their block) hold their values."""
        if max_pos < self.filled:
            return
        end = min(self.n_pos, (max_pos // FILL + 1) * FILL)
        rows = slice(self.filled, end)
        self.cos[rows], self.sin[rows] = rope_tables(self.cfg, end, self.freq_factors, start=self.filled)
        if self.has_local:
            self.cos_local[rows], self.sin_local[rows] = rope_tables(self.cfg, end, self.freq_factors, local=True,
                                                                     start=self.filled)
        self.filled = end
