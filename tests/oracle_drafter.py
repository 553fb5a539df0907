"""A drafter for tests of speculative decoding: it knows the plain continuations, so its drafts are right for a
while and then wrong, which exercises every rollback (tests/unit/test_speculation.py, tests/golden)."""
import numpy as np

from fastserve.config import SpecConfig

ORACLE = SpecConfig(type="ngram-simple", simple_size_m=6)     # the engine's settings the Oracle replaces the drafter of


class Oracle:
    """A drafter that knows the plain continuations: each draft is right for its first `good` tokens (0..k,
    in turn) and wrong after (the right token + 1)."""

    def __init__(self, seqs, n_vocab):
        self.seqs, self.n_vocab, self.calls, self.drafted = [np.asarray(q) for q in seqs], n_vocab, 0, 0

    def reset(self, slot):
        pass

    def propose(self, tokens, n_tokens, k_max, k_min, drafts, n_draft):
        total = 0
        for s in range(len(n_tokens)):
            k, n = int(min(k_max[s], drafts.shape[1])), int(n_tokens[s])
            n_draft[s] = 0
            if k <= 0:
                continue
            seq = next((q for q in self.seqs if len(q) > n and (q[:n] == tokens[s, :n]).all()), None)
            self.calls += 1
            good = self.calls % (k + 1)
            for j in range(k):
                t = int(seq[n + j]) if seq is not None and n + j < len(seq) else 0
                drafts[s, j] = t if j < good else (t + 1) % self.n_vocab
            n_draft[s], total = k, total + k
        self.drafted += total
        return total
