"""backends/rope.RopeTables: rows computed block by block as positions are reached hold the bits of
rope_tables over the whole context, for the global and the local tables."""
from types import SimpleNamespace

import numpy as np
import pytest

from fastserve.backends.rope import FILL, RopeTables, rope_tables


def _cfg(local, yarn=False):
    """yarn: gpt-oss's RoPE (YaRN over 4096 positions, the local layers scaled as the global ones)."""
    return SimpleNamespace(rope_dim=64, rope_base=1e6, rope_base_local=1e4, rope_scale=8.0, rope_attn_factor=1.19,
                           local_layers=(True, True, False) if local else (False,), rope_yarn=yarn, n_ctx_orig=4096,
                           rope_scale_local=8.0 if yarn else 1.0)


def _same_bits(a, b):
    assert a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


@pytest.mark.parametrize("yarn", [False, True])
def test_tables_filled_as_reached_have_the_bits_of_the_whole_context(yarn):
    n_pos = 5 * FILL + 123
    factors = np.random.default_rng(0).uniform(1, 4, 32).astype(np.float32)
    cfg = _cfg(local=True, yarn=yarn)
    want = rope_tables(cfg, n_pos, factors) + rope_tables(cfg, n_pos, factors, local=True)
    t = RopeTables(cfg, n_pos, factors)
    assert t.filled == FILL                             # the first block only, at start-up
    for p in (5, FILL - 1, FILL, 3 * FILL + 7, 2 * FILL, n_pos - 1):
        t.cover(p)
        assert t.filled > p and (t.filled % FILL == 0 or t.filled == n_pos)
        for got, w in zip((t.cos, t.sin, t.cos_local, t.sin_local), want):
            _same_bits(got[:t.filled], w[:t.filled])
    assert t.filled == n_pos
    assert not np.array_equal(want[0], want[2])           # the local base differs


def test_without_local_layers_the_local_tables_are_the_global_ones():
    t = RopeTables(_cfg(local=False), 3000, None)
    assert t.cos_local is t.cos and t.sin_local is t.sin
    t.cover(2999)
    _same_bits(t.cos, rope_tables(_cfg(local=False), 3000, None)[0])


def test_yarn_keeps_fast_pairs_and_interpolates_slow_ones():
    """YaRN (llama.cpp's rope_yarn): a pair turning more than beta_fast (32) times over the original context keeps
    its angle pos * theta_i, one turning fewer than beta_slow (1) times takes pos / scale * theta_i; both are scaled
    in magnitude by 1 + 0.1 ln(scale) (times rope.scaling.attn_factor)."""
    cfg, n = _cfg(local=False, yarn=True), 200
    cos, sin = rope_tables(cfg, n, None)
    theta = 1e6 ** (-np.arange(32) * 2.0 / 64)
    pos = np.arange(n)[:, None]
    mag = 1.19 * (1 + 0.1 * np.log(8.0))
    np.testing.assert_allclose(cos[:, :2], np.cos(pos * theta[:2]) * mag, atol=2e-6)
    np.testing.assert_allclose(sin[:, -4:], np.sin(pos / 8.0 * theta[-4:]) * mag, atol=2e-6)
    plain = rope_tables(_cfg(local=False), n, None)[1]
    np.testing.assert_allclose(plain[:, -4:], np.sin(pos / 8.0 * theta[-4:]) * 1.19, atol=2e-6)


def test_yarn_below_a_factor_of_one_keeps_the_magnitude():
    """llama.cpp's get_mscale is 1 for a factor <= 1, so the attn_factor it passes (1 / (1 + 0.1 ln factor)) undoes
    ggml's magnitude (1 + 0.1 ln factor): cos and sin keep rope.scaling.attn_factor alone (they were scaled by
    1 + 0.1 ln 0.5 = 0.93 here)."""
    cfg = SimpleNamespace(**{**vars(_cfg(local=False, yarn=True)), "rope_scale": 0.5})
    cos, sin = rope_tables(cfg, 300, None)
    np.testing.assert_allclose(np.hypot(cos, sin), 1.19, rtol=2e-6)
