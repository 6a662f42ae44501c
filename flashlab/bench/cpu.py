"""``python -m flashlab bench cpu``: chapter 5's forward passes on the CPU, time and peak memory, recorded.

Runs :func:`flashlab.cpu_bench.run` (NumPy naive, NumPy tiled, Numba tiled, Numba fast) at n = 512 ... 4096,
d = 64, float32, on one thread and on all cores (BLAS and Numba alike), prints the table and the chapter's targets,
and with ``--record NAME`` writes data/cpu_bench/NAME.json: the rows, their summary, the machine and versions it
ran on, and what else the machine was running before and after.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import subprocess
import sys

from .. import cpu_bench, records
from . import PROG

OUT_DIR = records.DATA_DIR / "cpu_bench"
MEMORY_METHODS = {"numpy": "tracemalloc peak", "numba": "max(analytic account, RSS growth)"}
TIMING = "median of rounds x repeat calls per row (times_s), implementations alternating round by round"


def machine_activity(limit: int = 5) -> list[str]:
    """The busiest other processes right now (``ps``), so a record says what else was running."""
    try:
        out = subprocess.run(["ps", "-eo", "pid,pcpu,args", "--sort=-pcpu", "--no-headers"], capture_output=True,
                             text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    busy = []
    for line in out.splitlines():
        pid, cpu, args = (line.split(None, 2) + ["", "", ""])[:3]
        if pid.isdigit() and int(pid) != os.getpid() and float(cpu or 0) >= 5.0:
            busy.append(f"{cpu}% {args}"[:100])
    return busy[:limit]


def _threading_layer() -> str | None:
    import numba

    try:
        return numba.threading_layer()
    except ValueError:  # no parallel region has run yet
        return None


def provenance(argv: list[str]) -> dict:
    """:func:`flashlab.records.base_provenance` and the CPU, its threads, BLAS and Numba a CPU record ran with."""
    import numba
    from threadpoolctl import threadpool_info

    nice = os.nice(0)  # below 0: the run had priority over the machine's other processes
    command = (f"nice -n {nice} " if nice else "") + records.command_line(f"{PROG} cpu", argv)
    return {
        **records.base_provenance(command),
        "cpu": cpu_bench.cpu_model(),
        "logical_cpus": os.cpu_count(),
        "numba_threads": numba.get_num_threads(),
        "niceness": nice,
        "numba_threading_layer": _threading_layer(),
        "blas": [{k: info.get(k) for k in ("internal_api", "version", "num_threads")}
                 for info in threadpool_info() if info.get("user_api") == "blas"],
        "platform": platform.platform(),
        "numba": numba.__version__,
    }


def parser() -> argparse.ArgumentParser:
    """The command line of this benchmark."""
    p = argparse.ArgumentParser(prog=f"{PROG} cpu", description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="+", default=list(cpu_bench.DEFAULT_SIZES), help="sequence lengths n")
    p.add_argument("--d", type=int, default=64, help="head dimension")
    p.add_argument("--block", type=int, default=64, help="block_q = block_k of the tiled versions")
    p.add_argument("--repeat", type=int, default=3, help="timed calls per block")
    p.add_argument("--rounds", type=int, default=3, help="blocks per implementation and n, alternating")
    p.add_argument("--threads", type=int, nargs="+", help="thread settings, BLAS and Numba alike "
                   "(default: 1 and all cores)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--record", metavar="NAME", help="write data/cpu_bench/NAME.json")
    return p


def main(argv: list[str] | None = None) -> int:
    """``python -m flashlab bench cpu [--sizes N ...] [--repeat R] [--rounds B] [--record NAME]``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    p = parser()
    args = p.parse_args(argv)
    if args.record is not None and not re.fullmatch(r"[A-Za-z0-9_.-]+", args.record):
        p.error("--record takes a plain name (letters, digits, '_', '-', '.'): it names data/cpu_bench/NAME.json")
    before = {"loadavg": list(os.getloadavg()), "busy_processes": machine_activity()}
    rows = cpu_bench.run(args.sizes, d=args.d, block=args.block, repeat=args.repeat, rounds=args.rounds,
                         seed=args.seed, threads=args.threads or (1, None))
    after = {"loadavg": list(os.getloadavg()), "busy_processes": machine_activity()}
    result = cpu_bench.summary(rows)
    print()
    print(cpu_bench.format_summary(result))
    if args.record:
        records.write_record(OUT_DIR, args.record, provenance(argv), rows,
                             machine_activity={"before": before, "after": after}, memory_methods=MEMORY_METHODS,
                             timing=TIMING, summary=result)
    return 0
