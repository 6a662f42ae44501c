"""``python -m flashlab.gpu.selfcheck``: launch every rung once per dtype at a small shape and compare.

Small enough to run under ``compute-sanitizer --tool memcheck`` and ``--tool racecheck`` (CONVENTIONS section 5):
a ragged shape (n = 77, m = 131: neither a multiple of any tile), GQA (2 query heads on 1 K/V head), causal with
n < m, and n > m so that some rows see no key. Exits non-zero if any output differs from naive attention.
"""

from __future__ import annotations

import sys

import numpy as np


def main(argv: list[str] | None = None) -> int:
    import cupy as cp

    from . import HEAD_DIMS, RUNGS, attention, from_bf16, naive_attention, to_bf16

    argv = sys.argv[1:] if argv is None else list(argv)
    names = argv or list(RUNGS)
    rng = cp.random.default_rng(2)
    bad = 0
    for name in names:
        for dt in RUNGS[name].dtypes:
            for d in HEAD_DIMS:
                for n, m, causal in ((77, 131, True), (131, 77, True), (77, 131, False)):
                    shape_q, shape_k = (1, 2, n, d), (1, 1, m, d)
                    q = rng.standard_normal(shape_q, dtype=cp.float32)
                    k = rng.standard_normal(shape_k, dtype=cp.float32)
                    v = rng.standard_normal(shape_k, dtype=cp.float32)
                    if dt == "bf16":
                        args = [to_bf16(x) for x in (q, k, v)]
                        q, k, v = (from_bf16(x) for x in args)
                    else:
                        args = [x.astype(np.float16 if dt == "f16" else np.float32) for x in (q, k, v)]
                    o, lse = attention(*args, causal=causal, kernel=name, bf16=dt == "bf16")
                    o = from_bf16(o) if dt == "bf16" else o.astype(cp.float32)
                    exact = (q, k, v) if dt == "bf16" else [x.astype(cp.float32) for x in args]
                    ref, lse_ref = naive_attention(*exact, causal=causal)  # fp32, on the rounded inputs
                    err = float(cp.abs(o - ref.astype(cp.float32)).max())
                    fin = cp.isfinite(lse_ref)
                    lerr = float(cp.abs(cp.where(fin, lse - lse_ref, 0)).max())
                    same_inf = bool((cp.isneginf(lse) == ~fin).all())
                    ok = err < 2e-2 and lerr < 1e-3 and same_inf
                    bad += not ok
                    print(f"{name:<12} {dt:<4} d={d:<4} n={n:<4} m={m:<4} causal={causal!s:<5} "
                          f"max|o-naive|={err:.1e} max|lse-naive|={lerr:.1e} {'ok' if ok else 'FAIL'}", flush=True)
    cp.cuda.Device().synchronize()
    print("selfcheck:", "all ok" if not bad else f"{bad} FAILED")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
