"""Pure-Python/NumPy twin of fastserve._attention: the same causal attention, row by row."""
import numpy as np


def attend(q, k_cache, v_cache, slots, positions, out, scratch, scale):
    """q [n, H, D]; k_cache, v_cache [n_slots, n_ctx_slot, Hkv, D]; slots, positions [n]; out [n, H*D]."""
    n, H, D = q.shape
    G = H // k_cache.shape[2]
    for t in range(n):
        slot, n_keys = int(slots[t]), int(positions[t]) + 1
        for h in range(H):
            keys = k_cache[slot, :n_keys, h // G].astype(np.float64)
            values = v_cache[slot, :n_keys, h // G].astype(np.float64)
            s = keys @ q[t, h].astype(np.float64) * float(scale)
            p = np.exp(s - s.max())
            out[t, h * D:(h + 1) * D] = (p @ values) / p.sum()
