"""float64 NumPy oracle shared by the decode-attention kernel tests."""

import numpy as np

from pallas_kernels.merge import MASK_VALUE


def oracle(q, k, v, token_lists, scale):
    """float64 attention; token_lists[b][h] is the list of attended positions."""
    q = np.asarray(q, np.float64)
    k = np.asarray(k, np.float64)
    v = np.asarray(v, np.float64)
    B, Hq, D = q.shape
    Hkv = k.shape[1]
    G = Hq // Hkv
    out = np.zeros((B, Hq, D))
    m = np.full((B, Hq), MASK_VALUE)
    l = np.zeros((B, Hq))
    for b in range(B):
        for h in range(Hkv):
            toks = np.asarray(token_lists[b][h], np.int64)
            if toks.size == 0:
                continue
            for g in range(G):
                i = h * G + g
                s = k[b, h, toks] @ q[b, i] * scale
                m[b, i] = s.max()
                p = np.exp(s - m[b, i])
                l[b, i] = p.sum()
                out[b, i] = p @ v[b, h, toks] / l[b, i]
    return out, m, l
