"""``python -m flashlab bench KIND ...``: time one kind of result and record it in data/ with its provenance.

One module per kind, each owning its arguments (``python -m flashlab bench KIND --help``). The GPU kinds share
one protocol (CONTRIBUTING.md, "Benchmarks"): every row of a table comes from one run, the references are timed
in the same run on the same random fp16 inputs, each output is checked once before it is timed, and times are
CUDA-event medians of --repeat (>= 20) runs after --warmup (:mod:`flashlab.records`), under each protocol of
--protocols (both by default: "throughput", calls back to back, and "latency", each call on an idle GPU; every
timed row names its ``protocol``). ``--table FILE`` prints a recorded file without a GPU. data/README.md lists
every recorded file and the command that regenerates it.
"""

from __future__ import annotations

import argparse
import itertools
import pathlib
import statistics
import sys
from collections.abc import Callable, Sequence

from .. import records
from ..cli import dispatch

DTYPES = ("float16", "bfloat16")

KINDS = {
    "forward": ("flashlab.bench.forward", "forward pass: the kernel ladder against naive CuPy and PyTorch SDPA "
                "-> data/benchmarks/NAME.json"),
    "backward": ("flashlab.bench.backward", "backward pass: the course's kernels against SDPA (flash, cuDNN) and "
                 "naive CuPy -> data/ch8/bwd.json"),
    "decode": ("flashlab.bench.decode", "split-KV decoding against SDPA and the time to read the KV cache once "
               "-> data/ch8/decode.json"),
    "memory": ("flashlab.bench.memory", "bytes kept from forward to backward, and each backward's extra "
               "-> data/ch8/memory.json"),
    "train": ("flashlab.bench.train", "a toy model trained with the course's kernels and with SDPA: both loss "
              "curves -> data/ch8/train.json"),
    "cpu": ("flashlab.bench.cpu", "NumPy naive, NumPy tiled, Numba tiled and Numba fast forward on the CPU, on one "
            "thread and on all cores: time and peak memory -> data/cpu_bench/NAME.json"),
    "tune": ("flashlab.bench.tune", "time a tunable rung with other tile sizes -> data/benchmarks/tune_RUNG.json"),
    "profile": ("flashlab.bench.profile", "one forward pass bracketed for Nsight Compute; summarize an ncu CSV "
                "into data/ncu/"),
    "ring": ("flashlab.bench.ring", "ring attention over several GPUs of one host against one GPU: time, hidden "
             "communication, link bandwidth, longest n that fits -> data/ring/NAME.json"),
    "host": ("flashlab.bench.host", "host time per call of attention, attention_backward and decode "
             "-> data/benchmarks/host.json"),
    "ablate": ("flashlab.bench.ablate", "rungs 6 and 8 with one change undone at a time, beside the rung before "
               "-> data/benchmarks/ablations.json"),
    "peak": ("flashlab.bench.peak", "the tensor-core ceiling of mma.sync (fp16, bf16) with nothing else in the "
             "loop -> data/benchmarks/peak.json"),
    "sparse": ("flashlab.bench.sparse", "block-sparse attention (sliding and dilated windows) against its density, "
               "dense causal and FlexAttention -> data/benchmarks/sparse.json"),
}
CAUSAL = {"no": [False], "yes": [True], "both": [False, True]}
PROG = "python -m flashlab bench"


def main(argv: list[str] | None = None) -> int:
    """``python -m flashlab bench KIND [ARGS...]``."""
    return dispatch(KINDS, sys.argv[1:] if argv is None else list(argv), PROG, word="KIND")


def record_parser(kind: str, description: str, *, name: str, out: pathlib.Path, repeat: int = 30,
                  warmup: int = 5) -> argparse.ArgumentParser:
    """The options every recorded GPU kind takes: where to write (--name, --out, --no-write), how many runs
    (--repeat, --warmup), and --table to print a recorded file instead of running."""
    p = argparse.ArgumentParser(prog=f"{PROG} {kind}", description=description)
    p.add_argument("--name", default=name, help=f"output file OUT/NAME.json (default: {name})")
    p.add_argument("--out", default=str(out), help=f"output directory (default: {out.relative_to(records.ROOT)})")
    p.add_argument("--repeat", type=int, default=repeat, help=f"timed runs per row (>= {records.MIN_REPEAT})")
    p.add_argument("--warmup", type=int, default=warmup, help="untimed runs before the timed ones")
    p.add_argument("--no-write", action="store_true", help="print the table only")
    p.add_argument("--table", metavar="JSON", help="print a recorded file and exit (no GPU)")
    return p


def add_dtypes(p: argparse.ArgumentParser) -> None:
    """--dtypes: the input precisions each shape is timed in (bfloat16 travels as uint16 bit patterns)."""
    p.add_argument("--dtypes", nargs="+", choices=DTYPES, default=["float16"],
                   help="float16 and/or bfloat16 inputs (default: float16)")


def add_protocols(p: argparse.ArgumentParser) -> None:
    """--protocols: the timing protocols each row is timed under (:data:`flashlab.records.PROTOCOLS`)."""
    p.add_argument("--protocols", nargs="+", choices=records.PROTOCOLS, default=list(records.PROTOCOLS),
                   help="throughput: calls back to back; latency: each call, then synchronize (default: both)")


def add_rounds(p: argparse.ArgumentParser) -> None:
    """--rounds, for the benchmarks that time through :func:`run_grid`: how many times each shape's implementations
    are timed, in the given order, then reversed, and so on."""
    p.add_argument("--rounds", type=int, default=1,
                   help="time each shape's implementations this many times, every other round in reverse order, "
                        "the median over all rounds' calls (a GPU that heats up favours the one timed first; "
                        "2 evens that out; default 1)")


def time_later_rounds(args: argparse.Namespace, rounds: int, timed: list[tuple]) -> None:
    """Rounds 2 .. ``rounds`` of --rounds: each (timed call, event kind, samples per protocol) of ``timed``, given
    in the first round's order, is timed again under every protocol of ``args``, every other round in reverse
    order; the new samples are appended to its lists."""
    for r in range(1, rounds):
        for fn, kind, times in (timed[::-1] if r % 2 else timed):
            for p in args.protocols:
                times[p] += records.cuda_times(fn, args.repeat, args.warmup, kind=kind, protocol=p)


def training_kernel_hashes() -> dict:
    """Provenance of the backward and decoding records: the hashes of the backward and decoding kernel sources."""
    from ..gpu import KERNEL_DIR, backward, decoding

    return {"kernel_sha256_ch8": records.file_hashes(KERNEL_DIR / f for f in backward.KERNEL_FILES
                                                     + decoding.KERNEL_FILES)}


def gpu_main(kind: str, argv: list[str], p: argparse.ArgumentParser, run: Callable[[argparse.Namespace, list], None],
             format_rows: Callable[[list[dict]], str], *, prepare: Callable[[argparse.Namespace], None] | None = None,
             format_recorded: Callable[[list[dict]], str] | None = None,
             extra_provenance: Callable[[], dict] | None = None) -> int:
    """Parse ``argv``; print a recorded table (--table) or run ``run(args, rows)`` on the GPU, print the rows,
    and write OUT/NAME.json with the provenance unless --no-write.

    ``prepare(args)`` adjusts the arguments once CuPy is known to import (e.g. drops the PyTorch references when
    PyTorch is missing); ``format_recorded`` formats --table (default ``format_rows``).
    """
    args = p.parse_args(argv)
    if args.table:
        records.print_recorded(args.table, format_recorded or format_rows)
        return 0
    records.check_repeat(args.repeat)
    try:
        import cupy  # noqa: F401
    except ImportError:
        raise SystemExit("the benchmark needs CuPy and an NVIDIA GPU") from None
    if prepare is not None:
        prepare(args)
    prov = records.gpu_provenance(records.command_line(f"{PROG} {kind}", argv))
    if extra_provenance is not None:
        prov.update(extra_provenance())
    print(f"# {prov['gpu']}  CuPy {prov['cupy']}  torch {prov.get('torch')}  {prov['date_utc']}")
    rows: list[dict] = []
    prov["gpu_state_start"] = records.gpu_state()
    run(args, rows)
    prov["gpu_state_end"] = records.gpu_state()
    print()
    print(format_rows(rows))
    if not args.no_write:
        records.write_record(args.out, args.name, prov, rows)
    return 0


def timed_row(base: dict, ms: float, flop: float, repeat: int, err: float | None, diff_against: str | None,
              extra_bytes: int) -> dict:
    """A timed forward or backward row: ``base`` (impl, pass, shape) plus the median, TFLOP/s, the difference
    against the reference implementation and the extra bytes CuPy's pool held after one call."""
    return {**base, "median_ms": round(ms, 5), "tflops": round(flop / (ms * 1e-3) / 1e12, 3), "repeat": repeat,
            "max_abs_diff": err, "diff_against": diff_against, "extra_bytes": int(extra_bytes)}


def copy_gbps(nbytes: int, repeat: int, warmup: int) -> float:
    """The copy bandwidth in GB/s, the benchmarks' measure of what this GPU's memory delivers in the same run: a
    device-to-device copy of ``nbytes`` (CuPy, median of ``repeat``) reads and writes ``nbytes``, 2 ``nbytes`` moved."""
    import cupy as cp

    src = cp.ones(nbytes // 2, dtype=cp.float16)
    dst = cp.empty_like(src)
    return 2 * nbytes / (records.median_ms(lambda: cp.copyto(dst, src), repeat, warmup) * 1e-3) / 1e9


def max_diff(a, b) -> float:
    """max |a - b| over two CuPy arrays (or two equally long tuples of them), in float32."""
    import cupy as cp

    if isinstance(a, (tuple, list)):
        return max(max_diff(x, y) for x, y in zip(a, b, strict=True))
    return float(cp.abs(a.astype(cp.float32) - b.astype(cp.float32)).max())


def run_grid(args: argparse.Namespace, rows: list[dict], *, pass_name: str, inputs: int,
             impl: Callable[[str, list, bool], tuple[str, Callable[[], object], Callable[[], object]]],
             flop: Callable[[int, int, int, int, bool], float], references: Sequence[str] = (),
             skip: Callable[[str, int], bool] = lambda name, n: False) -> None:
    """The loop the forward and backward benchmarks share: for each dtype of ``args.dtypes`` (float16 when the
    parser has none) and each (d, n, causal) of ``args``, ``inputs`` random arrays of shape (batch, heads, n, d)
    (bfloat16 as its bit patterns in uint16, as ``flashlab.gpu`` takes it); then every implementation of
    ``args.impls`` (but those ``skip`` names) is checked once and timed under every protocol of ``args.protocols``,
    one row per protocol.

    ``impl(name, arrays, causal)`` returns (event kind, the timed call, a call that poisons or allocates its
    outputs, runs once and returns them as float32). Differences are taken against the first of ``references``
    that runs, else against the first implementation timed. With ``args.rounds`` > 1 the implementations of a shape
    are timed again after the first round, in reverse order every other round, and a row's median is over the
    calls of every round (its ``rounds`` field says how many).
    """
    import cupy as cp

    from .. import gpu as fgpu

    rng = cp.random.default_rng(0)
    pool = cp.get_default_memory_pool()
    rounds = max(1, getattr(args, "rounds", 1))
    for dtype, d, n in itertools.product(getattr(args, "dtypes", ["float16"]), args.d, args.n):
        batch = args.batch if args.batch else max(1, args.tokens // n)
        for causal in CAUSAL[args.causal]:
            shape = (batch, args.heads, n, d)
            arrays = [rng.standard_normal(shape, dtype=cp.float32) for _ in range(inputs)]
            arrays = [fgpu.to_bf16(x) if dtype == "bfloat16" else x.astype(cp.float16) for x in arrays]
            ref, ref_name = None, None
            for cand in [r for r in references if r in args.impls]:
                try:
                    ref, ref_name = impl(cand, arrays, causal)[2](), cand
                    break
                except Exception:  # noqa: BLE001 - e.g. naive attention out of memory at large n
                    pool.free_all_blocks()
            timed = {}  # name -> (base, kind, fn, times, err, extra), in the order of args.impls
            for name in args.impls:
                if skip(name, n):
                    continue
                base = {"impl": name, "pass": pass_name, "dtype": dtype, "d": d, "n": n, "batch": batch,
                        "heads": args.heads, "causal": causal}
                pool.free_all_blocks()
                held = pool.total_bytes()
                try:
                    kind, fn, result = impl(name, arrays, causal)
                    out = result()
                    # What CuPy's pool held after one call beyond before it (outputs, temporaries, a float32
                    # copy made for the check; PyTorch's allocator is not seen): about the call's working memory.
                    extra = pool.total_bytes() - held
                    if ref is None:
                        ref, ref_name, err = out, name, None
                    else:
                        err = max_diff(out, ref)
                    del out
                    times = {p: records.cuda_times(fn, args.repeat, args.warmup, kind=kind, protocol=p)
                             for p in args.protocols}
                except Exception as e:  # noqa: BLE001 - e.g. out of memory: recorded, the table goes on
                    rows.append(failed_row(base, e))
                    pool.free_all_blocks()
                    continue
                # one round: nothing kept of the call (its outputs freed before the next implementation runs)
                timed[name] = (base, kind, fn if rounds > 1 else None, times, err, extra)
                del fn
                if rounds == 1:
                    pool.free_all_blocks()
            time_later_rounds(args, rounds, [(fn, kind, times) for _, kind, fn, times, _, _ in timed.values()])
            for name, (base, _, _, times, err, extra) in timed.items():
                f = flop(n, d, batch, args.heads, causal)
                for protocol, samples in times.items():
                    ms = statistics.median(samples)
                    row = timed_row({**base, "protocol": protocol}, ms, f, args.repeat, err, ref_name, extra)
                    rows.append({**row, "rounds": rounds} if rounds > 1 else row)
                    print(f"  {name:<12} {dtype:<8} d={d:<4} n={n:<6} causal={causal!s:<5} {protocol:<10} "
                          f"{ms:9.3f} ms {rows[-1]['tflops']:8.2f} TFLOP/s  max|diff vs {ref_name}|={err}  "
                          f"+{extra / 1e6:.0f} MB", flush=True)
            timed.clear()
            del arrays, ref
            pool.free_all_blocks()


def ratio_cells(row: dict, times: dict, refs: Sequence[str] = ("sdpa_flash", "sdpa_cudnn"),
                key: Callable[[dict], tuple] = lambda r: (r["d"], r["n"], r["causal"])) -> list[str]:
    """``row``'s speed as a multiple of each reference's in the same run, same shape and same protocol: the
    reference's median time over the row's ("-" where the run has no such reference). ``times`` maps
    (impl, protocol, *key) to median ms."""
    p = records.protocol_of(row)
    out = []
    for ref in refs:
        t = times.get((ref, p, *key(row)))
        out.append(f"{t / row['median_ms']:.2f}" if t else "-")
    return out


def median_times(rows: list[dict], key: Callable[[dict], tuple] = lambda r: (r["d"], r["n"], r["causal"])) -> dict:
    """(impl, protocol, *key) -> median ms of every timed row, for :func:`ratio_cells`."""
    return {(r["impl"], records.protocol_of(r), *key(r)): r["median_ms"] for r in rows if "error" not in r}


def failed_row(base: dict, e: Exception) -> dict:
    """A row whose run failed (out of memory, say): printed and recorded with its error; the table goes on."""
    print(f"  {base['impl']:<12} d={base['d']} n={base['n']} causal={base['causal']}: {type(e).__name__}: "
          f"{str(e)[:200]}")
    return {**base, "error": f"{type(e).__name__}: {str(e)[:200]}"}


def error_line(row: dict) -> str:
    """A failed row (out of memory, say) in a printed table."""
    return f"{row['impl']:<12} {row.get('n')} {row.get('m', '')}  {row['error'][:80]}"


def without_torch(impls: list[str], quiet: bool = False) -> list[str]:
    """``impls`` without the PyTorch references (sdpa_*) when PyTorch is not installed."""
    try:
        import torch  # noqa: F401
    except ImportError:
        dropped = [i for i in impls if i.startswith("sdpa")]
        if dropped and not quiet:
            print(f"PyTorch not installed: skipping {dropped}")
        return [i for i in impls if not i.startswith("sdpa")]
    return list(impls)
