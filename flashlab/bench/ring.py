"""``python -m flashlab bench ring``: ring attention on several GPUs of one host against one GPU.

One run, one process per GPU (:mod:`flashlab.gpu.ring`), fp16 inputs of shape (1, --heads, n, --d) drawn from one
seed on every GPU, non-causal. Rows:

* ``single``: ``flashlab.gpu.attention`` on GPU 0 over the whole sequence (the same attention on one GPU);
* ``ring``: the ring over --world GPUs (each GPU's time; the row keeps the slowest GPU's median);
* ``ring_compute`` and ``ring_transfer``: the ring with its transfers left out (every step computes on the GPU's
  own block: the same work) and with its computation left out (the blocks only travel): the two halves of a step,
  from which ``hidden`` = (compute + transfer - ring) / transfer, the fraction of the transfer time hidden under
  computation;
* ``link``: one ring step's exchange alone (send one K/V block to the next GPU, receive one from the previous),
  its bytes per direction and GB/s (1 GB = 10^9 bytes), with ``peer_access`` (can GPU 0 map GPU 1's memory);
* ``fit``: the longest n whose buffers this implementation allocates on 1 GPU (Q, K, V, O in fp16 and L) and on
  --world GPUs (per GPU: its rows of Q, two K/V blocks in flight, the float32 accumulators of O and L, and one
  kernel call's partial), found by allocating them (binary search in steps of --fit-step tokens per GPU).

Every timed call was checked first: the ring's (O, L) of each GPU's rows against ``flashlab.gpu.attention`` of
those rows over all keys on that GPU (``max_abs_diff``). CUDA-event medians of --repeat runs under each protocol of
--protocols. Set NCCL_DEBUG=INFO to see the transport NCCL picks (P2P over NVLink or PCIe, or shared memory).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import traceback

from .. import records
from .. import ring as _ring
from . import add_protocols, gpu_main, record_parser

OUT_DIR = records.DATA_DIR / "ring"


def parser() -> argparse.ArgumentParser:
    """The command line of this benchmark."""
    p = record_parser("ring", __doc__.splitlines()[0], name="h200x2", out=OUT_DIR, repeat=20, warmup=3)
    p.add_argument("--n", type=int, nargs="+", default=[131072], help="sequence lengths (whole sequence)")
    p.add_argument("--heads", type=int, default=16, help="heads (one layer: batch 1)")
    p.add_argument("--d", type=int, default=128, choices=(64, 128), help="head dimension")
    p.add_argument("--world", type=int, default=2, help="GPUs in the ring")
    p.add_argument("--head-slab", type=int, default=4, help="heads per kernel call (bounds the partial's memory)")
    p.add_argument("--fit-step", type=int, default=4096, help="granularity of the longest-n search, tokens per GPU")
    p.add_argument("--no-fit", action="store_true", help="skip the longest-n search")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds before a stuck GPU makes the run fail")
    add_protocols(p)
    return p


# ------------------------------------------------------------------------------------------ on each GPU
def _inputs(cp, n: int, heads: int, d: int, seed: int = 0):
    rng = cp.random.default_rng(seed)
    shape = (1, heads, n, d)
    return [rng.standard_normal(shape, dtype=cp.float32).astype(cp.float16) for _ in range(3)]


def _timed(fn, args, protocol: str, kind: str = "cupy") -> dict:
    ts = records.cuda_times(fn, args["repeat"], args["warmup"], kind=kind, protocol=protocol)
    return {"median_ms": round(statistics.median(ts), 5), "repeat": len(ts)}


def _shard(cp, gring, q, k, v, world: int, rank: int):
    n = q.shape[2]
    rows = _ring.split(n, world, "contiguous")
    q_pos = [gring._layout_chunks(r) for r in rows]
    lo, ln = q_pos[rank][0]
    block_shapes = [[k.shape[:-2] + (c[1], k.shape[-1]) for c in qp] for qp in q_pos]
    shard = gring.Shard(cp, [cp.ascontiguousarray(q[:, :, lo:lo + ln])], q_pos[rank], block_shapes, q_pos,
                        q.dtype, v.shape[-1])
    (kk, vv), = shard.views(shard.buffers[0], rank)
    kk[...] = k[:, :, lo:lo + ln]
    vv[...] = v[:, :, lo:lo + ln]
    return shard, (lo, ln)


def _fits(cp, alloc) -> bool:
    pool = cp.get_default_memory_pool()
    held = []
    try:
        for shape, dtype in alloc:
            held.append(cp.empty(shape, dtype=dtype))
        cp.cuda.Device().synchronize()
        return True
    except cp.cuda.memory.OutOfMemoryError:
        return False
    finally:
        del held
        pool.free_all_blocks()


def _longest(cp, alloc_for, step: int) -> int:
    """The largest multiple of ``step`` whose allocation ``alloc_for(n)`` succeeds (0 if none)."""
    lo, hi = 0, step
    while _fits(cp, alloc_for(hi)):
        lo, hi = hi, hi * 2
    while hi - lo > step:
        mid = (lo + hi) // 2 // step * step
        lo, hi = (mid, hi) if _fits(cp, alloc_for(mid)) else (lo, mid)
    return lo


def _single_alloc(heads: int, d: int):
    import numpy as np

    return lambda n: [((1, heads, n, d), np.float16)] * 4 + [((1, heads, n), np.float32)]


def _ring_alloc(heads: int, d: int, slab: int):
    import numpy as np

    def alloc(n_local: int):
        # what ring_forward holds per GPU: Q rows, two K/V blocks, float32 O and L accumulators, and one kernel
        # call's partial o (fp16) and lse with the merge's float32 temporaries of the same size
        return ([((1, heads, n_local, d), np.float16), ((2 * 2 * heads * n_local * d,), np.float16),
                 ((1, heads, n_local, d), np.float32), ((1, heads, n_local), np.float32),
                 ((1, slab, n_local, d), np.float16), ((1, slab, n_local), np.float32)]
                + [((1, slab, n_local, d), np.float32)] * 2 + [((1, slab, n_local), np.float32)] * 3)
    return alloc


def _bench_n(cp, dr, gring, attention, n: int, args: dict) -> list[dict]:
    """All rows of one sequence length on this GPU."""
    rank, world = dr.rank, dr.world
    heads, d, slab = args["heads"], args["d"], args["head_slab"]
    base = {"n": n, "heads": heads, "d": d, "world": world, "dtype": "float16", "causal": False, "rank": rank}
    rows = []
    q, k, v = _inputs(cp, n, heads, d)
    shard, (lo, ln) = _shard(cp, gring, q, k, v, world, rank)
    scale = 1.0 / d ** 0.5

    def ring_call(compute=True, transfer=True):
        gring.ring_forward(dr, shard, causal=False, scale=scale, offset=0, compute=compute, transfer=transfer,
                           head_slab=slab)

    dr.barrier()
    ring_call()
    dr.wait(dr.compute.record(), "the ring")
    o_ref, lse_ref = attention(cp.ascontiguousarray(q[:, :, lo:lo + ln]), k, v, scale=scale)
    diff = max(float(cp.abs(shard.o[0] - o_ref.astype(cp.float32)).max()),
               float(cp.abs(shard.lse[0] - lse_ref).max()))
    del o_ref, lse_ref
    flop = 4.0 * n * n * d * heads
    if rank == 0:
        out = (cp.empty_like(q), cp.empty(q.shape[:-1], dtype=cp.float32))
        attention(q, k, v, scale=scale, out=out)
        for protocol in args["protocols"]:
            t = _timed(lambda: attention(q, k, v, scale=scale, out=out), args, protocol)
            rows.append({**base, "impl": "single", "protocol": protocol, **t,
                         "tflops": round(flop / (t["median_ms"] * 1e-3) / 1e12, 3)})
        del out
    for protocol in args["protocols"]:
        dr.barrier()
        t = _timed(ring_call, args, protocol)
        rows.append({**base, "impl": "ring", "protocol": protocol, **t, "max_abs_diff": diff,
                     "diff_against": "flashlab.gpu.attention of the same rows on one GPU",
                     "tflops": round(flop / (t["median_ms"] * 1e-3) / 1e12, 3)})
    dr.barrier()
    t = _timed(lambda: ring_call(transfer=False), args, "throughput")
    rows.append({**base, "impl": "ring_compute", "protocol": "throughput", **t})
    dr.barrier()
    t = _timed(lambda: ring_call(compute=False), args, "throughput")
    rows.append({**base, "impl": "ring_transfer", "protocol": "throughput", **t})
    if world > 1:
        dr.barrier()
        nbytes = shard.block_bytes(rank)
        a, b = shard.buffers
        t = _timed(lambda: dr.exchange(a[:nbytes], b[:nbytes], dr.compute), args, "throughput")
        peer = bool(cp.cuda.runtime.deviceCanAccessPeer(rank, (rank + 1) % world))
        rows.append({**base, "impl": "link", "protocol": "throughput", **t, "bytes": nbytes,
                     "gbs": round(nbytes / (t["median_ms"] * 1e-3) / 1e9, 3), "peer_access": peer,
                     "nccl_p2p_disable": os.environ.get("NCCL_P2P_DISABLE")})
    dr.barrier()
    return rows


def _bench_worker(rank: int, world: int, uid, args: dict, results, timeout: float) -> None:
    """Everything one GPU does in the benchmark; puts ("ok", rank, rows) on ``results``."""
    try:
        import cupy as cp

        from ..gpu import attention
        from ..gpu import ring as gring

        dr = gring.DeviceRing(rank, world, uid, timeout)
        rows = []
        heads, d, slab = args["heads"], args["d"], args["head_slab"]
        with dr.compute:
            for n in args["n"]:
                rows += _bench_n(cp, dr, gring, attention, n, args)
                cp.get_default_memory_pool().free_all_blocks()
            if not args["no_fit"]:
                dr.barrier()
                if rank == 0:
                    n1 = _longest(cp, _single_alloc(heads, d), args["fit_step"])
                    rows.append({"impl": "fit", "gpus": 1, "n": n1, "heads": heads, "d": d, "rank": rank})
                dr.barrier()
                n_local = _longest(cp, _ring_alloc(heads, d, min(slab, heads)), args["fit_step"])
                rows.append({"impl": "fit", "gpus": world, "n_per_gpu": n_local, "n": n_local * world,
                             "heads": heads, "d": d, "rank": rank})
                dr.barrier()
        results.put(("ok", rank, rows))
    except BaseException:  # noqa: BLE001 - the caller must hear of any failure instead of waiting
        results.put(("error", rank, traceback.format_exc()))


def _combine(per_rank: list[list[dict]]) -> list[dict]:
    """One row per measurement: a ring row keeps the slowest GPU's median (the call ends when every GPU is done),
    the fit keeps the smallest per-GPU length (every GPU must hold its rows), then ``hidden`` per n."""
    by_key: dict[tuple, list[dict]] = {}
    for rows in per_rank:
        for r in rows:
            by_key.setdefault((r["impl"], r.get("n") if r["impl"] != "fit" else r["gpus"], r.get("protocol")),
                              []).append(r)
    out = []
    for (impl, _, _), rs in by_key.items():
        if impl == "fit" and rs[0]["gpus"] > 1:
            row = min(rs, key=lambda r: r["n_per_gpu"])
            row = {**row, "n": row["n_per_gpu"] * row["gpus"]}
        elif impl == "fit" or impl == "single":
            row = rs[0]
        else:
            row = max(rs, key=lambda r: r["median_ms"])
            if impl == "ring":
                row = {**row, "max_abs_diff": max(r["max_abs_diff"] for r in rs)}
            if impl == "link":
                row = {**row, "gbs": min(r["gbs"] for r in rs)}
        row = {k: v for k, v in row.items() if k != "rank"}
        out.append(row)
    for r in out:
        if r["impl"] != "ring" or r["protocol"] != "throughput":
            continue
        get = {x["impl"]: x for x in out if x.get("n") == r["n"] and x.get("protocol") == "throughput"}
        if "ring_compute" in get and "ring_transfer" in get:
            comp, tran = get["ring_compute"]["median_ms"], get["ring_transfer"]["median_ms"]
            r["hidden"] = round(max(0.0, min(1.0, (comp + tran - r["median_ms"]) / tran)), 4) if tran > 0 else None
        if "single" in get:
            r["speedup_vs_single"] = round(get["single"]["median_ms"] / r["median_ms"], 3)
    for r in out:
        if r["impl"] == "ring" and r["protocol"] == "latency":
            single = [x for x in out if x["impl"] == "single" and x["n"] == r["n"] and x["protocol"] == "latency"]
            if single:
                r["speedup_vs_single"] = round(single[0]["median_ms"] / r["median_ms"], 3)
    return out


def run(args: argparse.Namespace, rows: list) -> None:
    """Start one process per GPU, run the benchmark on each, combine their rows."""
    import cupy as cp
    from cupy.cuda import nccl

    from ..gpu import ring as gring

    if cp.cuda.runtime.getDeviceCount() < args.world:
        raise SystemExit(f"--world {args.world} needs {args.world} GPUs; this host has "
                         f"{cp.cuda.runtime.getDeviceCount()}")
    os.environ.update(gring.NCCL_ENV)
    uid = nccl.get_unique_id()
    opts = {k: getattr(args, k) for k in ("n", "heads", "d", "head_slab", "fit_step", "no_fit", "repeat", "warmup",
                                          "protocols")}
    per_rank = _ring.run_workers(_bench_worker, [(p, args.world, uid, opts) for p in range(args.world)],
                                 processes=True, timeout=args.timeout)
    rows.extend(_combine(per_rank))


def format_rows(rows: list[dict]) -> str:
    """The table: one line per row."""
    lines = [f"{'impl':<14}{'n':>10}{'protocol':>12}{'ms':>12}{'TFLOP/s':>10}  other"]
    for r in rows:
        other = {k: r[k] for k in ("speedup_vs_single", "hidden", "max_abs_diff", "gbs", "bytes", "peer_access",
                                   "gpus", "n_per_gpu") if r.get(k) is not None}
        ms = f"{r['median_ms']:.3f}" if "median_ms" in r else "-"
        tf = f"{r['tflops']:.1f}" if "tflops" in r else "-"
        lines.append(f"{r['impl']:<14}{r['n']:>10}{r.get('protocol') or '-':>12}{ms:>12}{tf:>10}  {other}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print it; write data/ring/NAME.json unless --no-write."""
    argv = sys.argv[1:] if argv is None else list(argv)
    return gpu_main("ring", argv, parser(), run, format_rows)
