"""Compiled CPU kernels of the solvers: row gather, inner recurrence, weight update.

The arithmetic type follows the arrays: the recurrence runs in the dtype of r,
with the payload already in that dtype and every constant derived from cpow
(cpow[0] == 1) or read from params, so no float64 literal widens a float32
recurrence. (Passing a numpy scalar type as an argument would do the same, but
typing it costs ~7 us per call, more than the kernel.) fastmath allows only
reassociation and contraction (vectorised dot products); NaN/Inf semantics stay
exact, because divergence is detected from non-finite losses.
"""

from __future__ import annotations

import numba
import numpy as np

from ._losses import LEAST_SQUARES, LOGISTIC

_FAST = {"reassoc", "contract", "nsz", "arcp"}


@numba.njit(cache=True, nogil=True)
def gather_float(X, idx, out):  # pragma: no cover - compiled
    """Copy rows idx of X into out, casting to out's dtype."""
    k, n = out.shape
    for i in range(k):
        src = X[idx[i]]
        dst = out[i]
        for j in range(n):
            dst[j] = src[j]


@numba.njit(cache=True, nogil=True)
def gather_bf16(bits, idx, out, scratch):  # pragma: no cover - compiled
    """Copy rows idx of BF16 bit patterns into out as floats (exact)."""
    k, n = out.shape
    as_float = scratch.view(np.float32)
    for i in range(k):
        src = bits[idx[i]]
        for j in range(n):
            scratch[j] = np.uint32(src[j]) << np.uint32(16)
        dst = out[i]
        for j in range(n):
            dst[j] = as_float[j]


@numba.njit(cache=True, nogil=True, fastmath=_FAST)
def recurrence(payload, y, const, idx, b, k, code, params, fit_intercept,
               cpow, r, u, rs, icpt_hist, losses):  # pragma: no cover - compiled
    """Run k inner steps from the reduced payload; return the sum of the k batch losses.

    Step j: z_j = c^j v_j + icpt_{j-1} - step * sum_{t<j} c^(j-1-t) G_jt r_t,
    r_j = phi(z_j, y_Bj). Writes r (r's dtype), rs = -step c^(k-1-t) r_t (the
    update's right-hand side, in rs's dtype), the intercept after each step and
    each step's mean loss. params = [step, intercept before step 0]; u is scratch.
    """
    one = cpow[0]
    zero = one - one
    half = one / (one + one)
    st = params[0]
    icpt = params[1]
    total = 0.0
    for j in range(k):
        off = j * b + (j * (j - 1) // 2) * b * b
        width = 1 + j * b
        # Scale the earlier residuals once per step, so each row's correction is one
        # contiguous dot product of length j*b (vectorised) instead of j short ones.
        for t in range(j):
            f = cpow[j - 1 - t]
            for q in range(b):
                u[t * b + q] = f * r[t * b + q]
        lsum = 0.0
        rsum = zero
        for i in range(b):
            row = payload[off + i * width:off + (i + 1) * width]
            corr = zero
            for q in range(j * b):
                corr += row[1 + q] * u[q]
            z = cpow[j] * row[0] + icpt - st * corr
            sample = idx[j * b + i]
            yi = y[sample]
            if code == LEAST_SQUARES:
                res = z - yi
                loss = half * res * res
            elif code == LOGISTIC:
                v = -yi * z
                if v > zero:
                    e = np.exp(-v)
                    loss = v + np.log1p(e)
                    res = -yi * (one / (one + e))
                else:
                    e = np.exp(v)
                    loss = np.log1p(e)
                    res = -yi * (e / (one + e))
            else:
                e = np.exp(z)
                res = e - yi
                loss = e - yi * z + const[sample]
            r[j * b + i] = res
            rsum += res
            lsum += loss
        if fit_intercept:
            icpt = icpt - st * rsum
        icpt_hist[j] = icpt
        losses[j] = lsum / b
        total += losses[j]
    for j in range(k):
        f = -st * cpow[k - 1 - j]
        for i in range(b):
            rs[j * b + i] = f * r[j * b + i]
    return total


@numba.njit(cache=True, nogil=True)
def scale_add(w, g, cpow, k, mirror):  # pragma: no cover - compiled
    """Set w = cpow[k] * w + g and copy w into mirror (the panel's weight row)."""
    c = cpow[k]
    for i in range(w.shape[0]):
        v = c * w[i] + g[i]
        w[i] = v
        mirror[i] = v
