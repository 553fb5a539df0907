"""Token sampler, pure-Python twin of fastserve/_sampling.pyx: the readable statement
of what the sampler does. Same class, same methods, same token ids bit for bit.

The chain is llama.cpp's default one (common/sampling.cpp), per row:
  logit bias -> penalties (repeat/presence/frequency over the slot's last
  repeat_last_n tokens) -> top-k -> top-p -> min-p -> temperature -> draw.
temperature <= 0 is greedy: the argmax after bias and penalties.

Rules both implementations follow exactly (they are what makes parity exact):
- Rank order: higher logit first, equal logits -> lower token id first. Every
  "top" (top-k, top-p prefix, greedy, n_probs lists) uses it.
- A token is a candidate only if its effective logit is > -inf; NaN logits are
  never sampled nor listed. A row with no candidate yields token 0.
- Constraints: a slot configured with constrained=True reads its row of `masks`
  (uint32 words; bit t % 32 of word t // 32 set = token t allowed). Its logits
  become -inf wherever the bit is 0 before every other stage (bias, penalties,
  the cuts and n_probs all see only allowed tokens); with no allowed candidate
  the row yields -1 and its penalty history is left as it was.
- Bias and penalties are float32 arithmetic, as in llama.cpp:
  x += bias; x = x * rp if x <= 0 else x / rp; x -= count * freq + present.
- Weights are fixed-point integers: q = trunc(exp((x - max) / temp) * 2**QBITS)
  with exp of double (libm, math.exp here) and QBITS = 63 - n_vocab.bit_length(),
  so a sum over the whole vocab fits in 63 bits. Integer sums do not depend on
  summation order, which lets the Cython side find the top-p cut without sorting
  the vocab and still agree with this sorted reference to the last bit. Tokens
  whose weight is below 2**-QBITS of the best one get q == 0 (never drawn).
- top-p keeps the shortest rank prefix whose mass reaches
  T = min(total, ceil(top_p * total)) (mass of the top-k set, before temperature).
- min-p keeps logits >= max + log(min_p) (double).
- The draw: u = splitmix64 output, r = (u * total) >> 64; walk the kept tokens in
  ascending id order and pick the first whose running mass exceeds r. Exactly one
  u is consumed per non-greedy row.
- Speculative decoding (drafts given): rows of one slot are sampled in order, each exactly as a
  plain decode step would (its draw, its history), and stop at the first sample that differs
  from the token the next row was fed. For a draft that is one token (an n-gram's, a greedy
  draft model's: q one-hot), accepting draft d with probability min(1, p(d)/q(d)) = p(d) and
  else drawing from the normalised max(0, p - q) is the same as drawing from p and keeping
  d when the draw is d: so the output is the plain sampler's, draw for draw, seed for seed.
- Probabilities reported: float32(q / total) (both as doubles). Pre-sampling:
  raw logits, whole vocab, temperature 1. Post-sampling: the kept set after
  temperature. Entries past the available candidates are id -1, prob 0.0.
  Arrays wider than n_probs get the sampled token's own entry in column n_probs (its id, its
  probability in the same distribution, whether or not it is listed; a weight truncated to 0
  is taken untruncated there); probability 0 when the row had no candidate.
"""
import math

import numpy as np

from fastserve.config import SAMPLING_DEFAULTS, _integer, check_fits, check_sampling as check_config  # the twins' shared checks
from fastserve.errors import RequestError

MASK64 = (1 << 64) - 1
REJECTED = -2       # a row after a rejected draft (fastserve.ref.slots.REJECTED)
N_DRAFT_MASKS = 8   # the most drafts a constrained slot verifies in one call (its draft_masks rows)
_GOLDEN = 0x9E3779B97F4A7C15


def splitmix64(state):
    """One splitmix64 step: (new_state, output), both uint64 as Python ints."""
    state = (state + _GOLDEN) & MASK64
    z = state
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return state, z ^ (z >> 31)


def quant_bits(n_vocab):
    """Fixed-point bits of a weight: n_vocab weights of at most 2**bits sum below 2**63."""
    return 63 - int(n_vocab).bit_length()


def weight(x, m, temp, scale):
    """Fixed-point weight of logit x given the row's max m: trunc(exp((x - m) / temp) * scale)."""
    if x == m:  # also covers x == m == +inf
        return int(scale)
    return int(math.exp((float(x) - float(m)) / temp) * scale)


def own_prob(x, m, temp, scale, total):
    """The sampled token's own probability: float32(q / total) as the lists', or, where its weight q
    truncates to 0 (a token far below the max), the same exp untruncated."""
    if not x > -math.inf or total == 0:
        return 0.0
    q = weight(x, m, temp, scale)
    if q:
        return float(q) / float(total)
    return math.exp((float(x) - float(m)) / temp) * scale / float(total)


def top_p_target(top_p, total):
    """The mass a top-p prefix must reach, as an integer."""
    return min(total, math.ceil(top_p * float(total)))


def check_sample_args(n_vocab, configured, n_probs, logits, row_slot, out_ids, probs_ids, probs):
    """Shape checks of sample(); `configured` and `n_probs` are per-slot sequences."""
    n_rows = len(row_slot)
    if logits.ndim != 2 or logits.shape[1] != n_vocab:
        raise ValueError(f"logits must be [n_rows, {n_vocab}], got shape {logits.shape}")
    if logits.shape[0] < n_rows or len(out_ids) < n_rows:
        raise ValueError(f"logits and out_ids need at least {n_rows} rows")
    for r in range(n_rows):
        s = int(row_slot[r])
        if not 0 <= s < len(configured):
            raise ValueError(f"row {r}: slot {s} out of range [0, {len(configured)})")
        if not configured[s]:
            raise ValueError(f"row {r}: slot {s} was never configured")
        n = n_probs[s]
        if n:
            for name, a in (("probs_ids", probs_ids), ("probs", probs)):
                if a is None or a.shape[0] <= r or a.shape[1] < n:
                    raise ValueError(f"row {r}: slot {s} asked for n_probs={n}; {name} must be at least "
                                     f"[{r + 1}, {n}]")


class _Slot:
    """One slot's parameters and state (the Cython side keeps them in a C struct)."""

    def __init__(self, cfg):
        self.__dict__.update(cfg)
        self.greedy = cfg["temperature"] <= 0.0
        self.rp = np.float32(cfg["repeat_penalty"])
        self.pp = np.float32(cfg["presence_penalty"])
        self.fp = np.float32(cfg["frequency_penalty"])
        self.penalize = self.repeat_last_n > 0 and not (self.rp == 1 and self.fp == 0 and self.pp == 0)
        self.bias = [(t, np.float32(b)) for t, b in cfg["logit_bias"]]
        self.rng = cfg["seed"]
        self.hist = list(cfg["history"])   # oldest first, at most repeat_last_n
        self.constrained = False           # set by configure(constrained=True)


class Sampler:
    """Per-slot token sampler over float32 logits [n_rows, n_vocab].

    Reference twin of fastserve._sampling.Sampler; see the module docstring for
    the exact rules. sample() leaves `logits` unchanged.
    """

    def __init__(self, n_slots, n_vocab, max_penalty_window=256, max_logit_bias=256):
        if n_slots < 1 or n_vocab < 1 or max_penalty_window < 0 or max_logit_bias < 0:
            raise ValueError("n_slots and n_vocab must be >= 1, the maxima >= 0")
        self.n_slots = int(n_slots)
        self.n_vocab = int(n_vocab)
        self.max_penalty_window = int(max_penalty_window)
        self.max_logit_bias = int(max_logit_bias)
        self._scale = float(1 << quant_bits(n_vocab))
        self._slots = [None] * self.n_slots
        self.n_mask_words = (self.n_vocab + 31) // 32
        self.masks = np.zeros((self.n_slots, self.n_mask_words), np.uint32)
        # a constrained slot's drafted rows: row j >= 1 of its run reads draft_masks[slot, j - 1]
        self.draft_masks = np.zeros((self.n_slots, N_DRAFT_MASKS, self.n_mask_words), np.uint32)

    def configure(self, slot, *, seed, history=(), constrained=False, **params):
        """Give `slot` a request's parameters (SamplingParams' fields; config.SAMPLING_DEFAULTS for those not
        given), its RNG seed, and its prompt as penalty history;
        constrained: sample only tokens whose bit is set in masks[slot]."""
        slot = _integer("slot", slot)
        if not 0 <= slot < self.n_slots:
            raise RequestError(f"slot {slot} out of range [0, {self.n_slots})")
        cfg = check_config(self.n_vocab, self.max_penalty_window, self.max_logit_bias, seed=seed, history=history,
                           **{**SAMPLING_DEFAULTS, **params})
        self.configure_checked(slot, cfg, constrained)

    def configure_checked(self, slot, cfg, constrained=False):
        """configure() with parameters check_config already normalized (SamplingParams.slot_config):
        only what this sampler's capacities bound is checked again."""
        if not 0 <= slot < self.n_slots:
            raise RequestError(f"slot {slot} out of range [0, {self.n_slots})")
        check_fits(cfg, self.max_penalty_window, self.max_logit_bias)
        self._slots[slot] = _Slot(cfg)
        self._slots[slot].constrained = bool(constrained)

    def history(self, slot):
        """The slot's penalty window, oldest token first (a new list)."""
        if not 0 <= slot < self.n_slots:
            raise IndexError(f"slot {slot} out of range [0, {self.n_slots})")
        st = self._slots[slot]
        return [] if st is None else list(st.hist)

    def greedy_rows(self, logits, out_ids):
        """out_ids[r] = argmax of logits[r] (ties -> lowest id, NaN ignored, no candidate -> 0)."""
        if logits.ndim != 2 or logits.shape[1] != self.n_vocab or len(out_ids) < logits.shape[0]:
            raise ValueError(f"logits must be [n_rows, {self.n_vocab}] and out_ids at least n_rows long")
        for r in range(logits.shape[0]):
            out_ids[r] = _argmax(logits[r])

    def sample(self, logits, row_slot, out_ids, probs_ids=None, probs=None, drafts=None):
        """Sample one token per row r for slot row_slot[r] into out_ids[r] and append it to
        that slot's penalty history. Slots with n_probs > 0 also get their top-n_probs
        ids/probabilities in probs_ids[r, :n] / probs[r, :n], and, where the arrays have more than n
        columns, the sampled token's own entry in column n; other rows are left alone.
        drafts (speculative decoding): drafts[r] >= 0 is the token the next row was fed; a row whose
        sample differs from it leaves the slot's following rows up to its last (drafts[r] == -1)
        unsampled: REJECTED (-2), no draw, no history."""
        check_sample_args(self.n_vocab, [s is not None for s in self._slots],
                          [0 if s is None else s.n_probs for s in self._slots],
                          logits, row_slot, out_ids, probs_ids, probs)
        if drafts is not None and len(drafts) < len(row_slot):
            raise ValueError(f"drafts needs at least {len(row_slot)} entries")
        runs = [0] * len(row_slot)          # a row's place in its slot's run of drafted rows
        for r in range(1, len(row_slot)):
            runs[r] = runs[r - 1] + 1 if drafts is not None and drafts[r - 1] >= 0 else 0
        for r, j in enumerate(runs):
            if j > N_DRAFT_MASKS and self._slots[int(row_slot[r])].constrained:
                raise ValueError(f"row {r}: a constrained slot verifies at most {N_DRAFT_MASKS} drafts")
        skip = False
        for r in range(len(row_slot)):
            if skip:
                out_ids[r] = REJECTED
                skip = drafts[r] >= 0
                continue
            st = self._slots[int(row_slot[r])]
            pids = probs_ids[r] if st.n_probs else None
            pp = probs[r] if st.n_probs else None
            row = logits[r]
            if st.constrained:
                s = int(row_slot[r])
                row = self._masked(s, row, None if runs[r] == 0 else self.draft_masks[s, runs[r] - 1])
            tok, own = self._sampled(st, row, pids, pp)
            out_ids[r] = tok
            if st.n_probs and probs_ids.shape[1] > st.n_probs and probs.shape[1] > st.n_probs:
                probs_ids[r, st.n_probs] = tok
                probs[r, st.n_probs] = np.float32(own)
            if st.repeat_last_n and tok >= 0:
                st.hist.append(tok)
                del st.hist[:-st.repeat_last_n]
            skip = drafts is not None and drafts[r] >= 0 and tok != drafts[r]

    # -- one row ---------------------------------------------------------------

    def _masked(self, slot, row, words=None):
        """A copy of row with -inf where masks[slot] (or the mask words given) disallows the token."""
        words = self.masks[slot] if words is None else words
        bits = np.unpackbits(words.astype("<u4").view(np.uint8), bitorder="little")[:self.n_vocab]
        return np.where(bits.astype(bool), np.asarray(row, np.float32), np.float32(-np.inf))

    def _effective(self, st, row):
        """Logits after bias and penalties (a float32 copy)."""
        x = np.array(row, dtype=np.float32, copy=True)
        with np.errstate(all="ignore"):   # inf - inf and overflow are meant: NaN / inf, as in C
            for t, b in st.bias:
                x[t] = x[t] + b
            if st.penalize and st.hist:
                counts = {}
                for t in st.hist:
                    counts[t] = counts.get(t, 0) + 1
                for t, c in counts.items():
                    v = x[t]
                    v = v * st.rp if v <= 0 else v / st.rp
                    v = v - (np.float32(c) * st.fp + np.float32(1.0) * st.pp)
                    x[t] = v
        return x

    def _rank(self, x):
        """Candidate ids in rank order (logit descending, id ascending)."""
        ids = np.flatnonzero(x > -np.inf)   # NaN and -inf are not candidates
        return ids[np.lexsort((ids, -x[ids]))]

    def _sample_row(self, st, row, pids, pp):
        """The row's token (tests/gpu/fake_cupy.py's emulation of the device sampler calls it)."""
        return self._sampled(st, row, pids, pp)[0]

    def _sampled(self, st, row, pids, pp):
        """(token, its own probability in the distribution n_probs lists)."""
        if not (st.n_probs and not st.post_sampling_probs):
            return self._draw_row(st, row, pids, pp)
        scale = self._scale
        raw = np.asarray(row, dtype=np.float32)
        order = self._rank(raw)
        m, total = -math.inf, 0
        if len(order):
            m = raw[order[0]]
            total = sum(weight(v, m, 1.0, scale) for v in raw[order].tolist())
        _write_probs([(int(t), float(weight(raw[t], m, 1.0, scale)) / float(total)) for t in order[:st.n_probs]],
                     st.n_probs, pids, pp)
        tok, _ = self._draw_row(st, row, pids, pp)
        return tok, own_prob(raw[tok], m, 1.0, scale, total) if tok >= 0 else 0.0

    def _draw_row(self, st, row, pids, pp):
        """(token, its share of the kept set: 1 greedy, 0 with no candidate); pre-sampling lists are the caller's."""
        scale = self._scale
        x = self._effective(st, row)
        order = self._rank(x)
        if len(order) == 0:
            if st.n_probs and st.post_sampling_probs:
                _write_probs([], st.n_probs, pids, pp)
            return (-1 if st.constrained else 0), 0.0
        m = x[order[0]]
        if st.greedy:
            tok = int(order[0])
            if st.n_probs and st.post_sampling_probs:
                _write_probs([(tok, 1.0)], st.n_probs, pids, pp)
            return tok, 1.0

        if st.top_k > 0:
            order = order[:st.top_k]
        n = len(order)
        if st.top_p < 1.0:
            q = [weight(v, m, 1.0, scale) for v in x[order].tolist()]
            target = top_p_target(st.top_p, sum(q))
            cum = 0
            for i, qi in enumerate(q):
                cum += qi
                if cum >= target:
                    n = i + 1
                    break
        if st.min_p > 0.0:
            thr = float(m) + math.log(st.min_p)
            below = np.flatnonzero(x[order[:n]].astype(np.float64) < thr)
            if len(below):
                n = int(below[0])
        kept = order[:n]
        q2 = {int(t): weight(x[t], m, st.temperature, scale) for t in kept}
        total2 = sum(q2.values())
        if st.n_probs and st.post_sampling_probs:
            _write_probs([(int(t), float(q2[int(t)]) / float(total2)) for t in kept[:st.n_probs]],
                         st.n_probs, pids, pp)
        st.rng, u = splitmix64(st.rng)
        r = (u * total2) >> 64
        cum = 0
        for t in sorted(q2):
            cum += q2[t]
            if cum > r:
                return t, float(q2[t]) / float(total2)
        raise AssertionError("unreachable: r < total2")


def _argmax(row):
    x = np.asarray(row, dtype=np.float32)
    ok = x > -np.inf
    if not ok.any():
        return 0
    m = x[ok].max()
    return int(np.flatnonzero(x == m)[0])


def _write_probs(top, n, pids, pp):
    for j in range(n):
        if j < len(top):
            pids[j] = top[j][0]
            pp[j] = np.float32(top[j][1])
        else:
            pids[j] = -1
            pp[j] = 0.0
