"""Solutions to notebook 12's exercises."""

import numpy as np


def accept_step(drafts, target_probs, draft_probs, rng):
    out = []
    for i, d in enumerate(drafts):
        p, q = target_probs[i], draft_probs[i]
        if rng.random() * q[d] < p[d]:  # keep with probability min(1, p/q)
            out.append(d)
            continue
        residual = np.maximum(p - q, 0.0)
        cdf = np.cumsum(residual)
        return out + [int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"))]
    cdf = np.cumsum(target_probs[len(drafts)])  # every draft kept: the bonus, from p at position k + 1
    return out + [int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"))]


def propose(token_ids, k, min_n, max_n):
    t = len(token_ids)
    for n in range(min(max_n, t - 1), min_n - 1, -1):
        suffix = token_ids[t - n:]
        for start in range(t - n - 1, -1, -1):  # latest first; a match ends before the last token
            if token_ids[start:start + n] == suffix:
                return token_ids[start + n:start + n + k]
    return []
