"""``python -m flashlab bench ablate``: rungs 6 and 8 with one of their changes undone at a time.

Rung 6 (`r6_exp2_tiles.cu`) makes four changes to rung 5 and rung 8 (`r8_lean_softmax.cu`) three to rung 7, each
file in one step. Each change can be undone alone by a define of the file (its header lists them), so this run
times, for each rung: the rung before, the rung, and the rung less each change, in one process, on the same
inputs, under both protocols. The drop from the rung to "the rung less X" is what X brings with the others in
place. A variant whose change does not act at a shape (the causal skip without a mask, the key tiles of d = 128 at
d = 64) is not timed there. Every output is checked against the rung's own. Written to data/benchmarks/NAME.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from .. import records
from . import add_protocols, gpu_main, record_parser
from .forward import OUT_DIR, flop

# rung -> (the rung before it, [(name, what the variant undoes, how it is built, the shapes it acts at)])
ABLATIONS = {
    "exp2_tiles": ("cp_async", [
        ("expf", "exponentials through expf, not one ex2.approx", ("-DABLATE_EXP2",), None),
        ("norm_each_tile", "P and O normalised every tile, not once at the end", ("-DABLATE_DEFERRED_NORM",), None),
        ("4_warps", "64-row blocks of 4 warps, not 128 rows of 8", ("-DNWARPS=4",), None),
        ("no_causal_skip", "causal blocks visit every key tile", ("-DABLATE_CAUSAL_SKIP",), "causal"),
    ]),
    "lean": ("warp32", [
        ("scaled_max", "the max in scaled units: a multiply and a subtract per exponent, not one FFMA",
         ("-DABLATE_RAW_MAX",), None),
        ("always_rescale", "O rescaled every tile, even when no row's max moved", ("-DABLATE_SKIP_RESCALE",), None),
        ("32_keys", "32-key tiles at d = 128 (rung 7's), not 64", ("-DBC_D128=32",), "d128"),
    ]),
}


def variant(rung: str, name: str, defines: tuple[str, ...]):
    """``rung`` with ``defines`` added, named RUNG-NAME (its shared memory follows the tile defines)."""
    from ..gpu import RUNGS, rung6_variant, rung7_variant

    base = RUNGS[rung]
    if "-DNWARPS=4" in defines:
        built = rung6_variant(4, 64)
    elif "-DBC_D128=32" in defines:
        built = rung7_variant(4, 64, 32, base=rung)
    else:
        built = dataclasses.replace(base, defines=base.defines + defines)
    return dataclasses.replace(built, name=f"{rung}-{name}")


def acts(where: str | None, d: int, causal: bool) -> bool:
    """Whether a variant's change acts at head size ``d`` with or without the causal mask."""
    return where is None or (where == "causal" and causal) or (where == "d128" and d == 128)


def parser() -> argparse.ArgumentParser:
    """The command line of this benchmark."""
    p = record_parser("ablate", __doc__.splitlines()[0], name="ablations", out=OUT_DIR, repeat=20, warmup=3)
    p.add_argument("--rungs", nargs="+", choices=tuple(ABLATIONS), default=list(ABLATIONS))
    p.add_argument("--d", nargs="+", type=int, default=[64, 128])
    p.add_argument("--n", nargs="+", type=int, default=[4096, 16384])
    p.add_argument("--tokens", type=int, default=16384, help="batch x n")
    p.add_argument("--heads", type=int, default=16)
    add_protocols(p)
    return p


def run(args: argparse.Namespace, rows: list[dict]) -> None:
    """Time the rung before, the rung and each variant at every shape, under each protocol; one row each."""
    import cupy as cp

    from ..gpu import RUNGS, attention

    rng = cp.random.default_rng(1)
    for d in args.d:
        for n in args.n:
            batch = max(1, args.tokens // n)
            for causal in (False, True):
                q, k, v = (rng.standard_normal((batch, args.heads, n, d), dtype=cp.float32).astype(cp.float16)
                           for _ in range(3))
                o = cp.empty_like(q)
                lse = cp.empty(q.shape[:-1], cp.float32)
                for rung in args.rungs:
                    before, changes = ABLATIONS[rung]
                    ref = attention(q, k, v, causal=causal, kernel=rung)[0].astype(cp.float32)
                    impls = [(before, RUNGS[before], None), (rung, RUNGS[rung], None)]
                    impls += [(f"{rung}-{name}", variant(rung, name, defines), what)
                              for name, what, defines, where in changes if acts(where, d, causal)]
                    for name, kern, what in impls:
                        def fn(kern=kern, q=q, k=k, v=v, causal=causal, o=o, lse=lse):
                            attention(q, k, v, causal=causal, kernel=kern, out=(o, lse))

                        fn()
                        err = float(cp.abs(o.astype(cp.float32) - ref).max())
                        if err > 1e-2:  # the same attention in fp16: a variant that differs more is wrong
                            raise SystemExit(f"{name} differs from {rung} by {err:.3g} at d={d} n={n} "
                                             f"causal={causal}")
                        for protocol in args.protocols:
                            ms = records.median_ms(fn, args.repeat, args.warmup, protocol=protocol)
                            f = flop(n, d, batch, args.heads, causal)
                            rows.append({"impl": name, "rung": rung, "undoes": what, "pass": "fwd",
                                         "dtype": "float16", "d": d, "n": n, "batch": batch, "heads": args.heads,
                                         "causal": causal, "protocol": protocol, "median_ms": round(ms, 5),
                                         "tflops": round(f / (ms * 1e-3) / 1e12, 3), "repeat": args.repeat,
                                         "max_abs_diff": err, "diff_against": rung})
                            print(f"  {name:<26} d={d:<3} n={n:<6} causal={causal!s:<5} {protocol:<10} "
                                  f"{ms:8.3f} ms {rows[-1]['tflops']:7.1f} TFLOP/s", flush=True)


def effects(rows: list[dict], rung: str) -> dict[str, list[float]]:
    """variant -> time(rung) / time(variant) at every shape and protocol both were timed (below 1: the change
    the variant undoes made the rung faster); the rung before against the rung likewise."""
    ms = {(r["impl"], r["d"], r["n"], r["causal"], records.protocol_of(r)): r["median_ms"]
          for r in rows if "error" not in r and r.get("rung") == rung}
    out: dict[str, list[float]] = {}
    for (impl, *shape), t in ms.items():
        if impl != rung and (rung, *shape) in ms:
            out.setdefault(impl, []).append(ms[(rung, *shape)] / t)
    return out


def markdown_table(rows: list[dict], rung: str) -> str:
    """Markdown: per variant, what it undoes and its speed as a multiple of the rung's at each d (every n, mask
    and protocol timed; lowest-highest)."""
    what = {r["impl"]: r.get("undoes") for r in rows if r.get("rung") == rung}
    out = ["| variant | what it undoes | d = 64 | d = 128 |", "|---|---|---|---|"]
    for impl in dict.fromkeys(r["impl"] for r in rows if r.get("rung") == rung and r["impl"] != rung):
        cells = []
        for d in (64, 128):
            sub = [r for r in rows if r["d"] == d]
            vals = effects(sub, rung).get(impl)
            cells.append(f"{min(vals):.2f}–{max(vals):.2f}×" if vals else "-")
        label = what[impl] or "the rung before"
        out.append(f"| `{impl}` | {label} | {cells[0]} | {cells[1]} |")
    return "\n".join(out)


def format_rows(rows: list[dict]) -> str:
    """One line per row, then each rung's table of variants."""
    lines = [f"{r['impl']:<26} d={r['d']:<3} n={r['n']:<6} causal={r['causal']!s:<5} {r['protocol']:<10} "
             f"{r['median_ms']:8.3f} ms {r['tflops']:7.1f} TFLOP/s" for r in rows if "error" not in r]
    for rung in dict.fromkeys(r["rung"] for r in rows if "rung" in r):
        lines += ["", markdown_table(rows, rung)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the ablations; print them; write data/benchmarks/NAME.json unless --no-write."""
    return gpu_main("ablate", sys.argv[1:] if argv is None else list(argv), parser(), run, format_rows)
