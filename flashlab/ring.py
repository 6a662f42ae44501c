"""Ring attention: one attention split across P devices by the sequence, chapter 1's merge across devices.

Each device p holds a block of queries Q_p and a block of keys and values K_p, V_p. It folds its own block into
the online-softmax state (m, l, u) of its queries, then passes its K/V block to the next device and receives the
previous device's, P - 1 times, folding every block that arrives with :func:`flashlab.online.update`. After P
blocks every query has seen every key, exactly once, and the state gives O = u / l and the logsumexp m + log l.
No device ever holds more than two K/V blocks, and the order in which blocks arrive does not matter (the online
softmax is exact in any order): what matters is that each block is masked with its own, global positions.

Layouts (:func:`split`): ``"contiguous"`` gives device p the p-th slice of the sequence; under a causal mask the
first device then has almost nothing to do (its queries see only the first keys) and the last one the most.
``"zigzag"`` cuts the sequence into 2P chunks and gives device p chunks p and 2P - 1 - p, one early and one late,
which evens the work out (:func:`work`).

Backends of :func:`attention`, one set of arguments: ``"cpu"``, P worker processes (multiprocessing, spawn) in
NumPy float64, neighbours joined by queues into a real ring; ``"threads"``, the same workers as threads in this
process (quick, for small inputs and tests); ``"gpu"``, one process per GPU, K/V blocks sent through NCCL while
the course's forward kernel computes (:mod:`flashlab.gpu.ring`). A worker that fails or hangs makes the call raise
:class:`RingError` within ``timeout`` seconds; it never hangs.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from . import online
from ._checks import causal_offset, check_qkv, check_scale

LAYOUTS = ("contiguous", "zigzag")
BACKENDS = ("cpu", "threads", "gpu")


class RingError(RuntimeError):
    """A worker of the ring failed, died or did not finish in time; the message names which and why."""


# ------------------------------------------------------------------------------------------------ layouts
def split(n: int, world: int, layout: str = "contiguous") -> list[np.ndarray]:
    """The global row indices each of ``world`` devices holds, for a sequence of ``n`` rows.

    ``"contiguous"``: device p holds the p-th of ``world`` slices (their lengths differ by at most one when
    ``world`` does not divide ``n``). ``"zigzag"``: the sequence is cut into 2 * world chunks the same way and
    device p holds chunks p and 2 * world - 1 - p. A device may hold no row when n < world (contiguous) or
    n < 2 * world (zigzag).
    """
    world = _check_world(world)
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}; got {layout!r}")
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
        raise ValueError(f"n must be a positive integer; got {n!r}")
    rows = np.arange(n)
    if layout == "contiguous":
        return list(np.array_split(rows, world))
    chunks = np.array_split(rows, 2 * world)
    return [np.concatenate([chunks[p], chunks[2 * world - 1 - p]]) for p in range(world)]


def _check_world(world) -> int:
    if isinstance(world, bool) or not isinstance(world, (int, np.integer)) or world < 1:
        raise ValueError(f"world must be a positive integer (the number of devices); got {world!r}")
    return int(world)


def source(rank: int, step: int, world: int) -> int:
    """The device whose K/V block device ``rank`` holds at ``step`` (0 = its own): blocks travel from p to p + 1,
    so at step s device p holds the block of device (p - s) mod world."""
    return (rank - step) % world


# --------------------------------------------------------------------------------------------- one device
def visible(q_pos: np.ndarray, k_pos: np.ndarray, *, causal: bool, offset: int) -> np.ndarray | None:
    """Which (query, key) pairs of a block may be seen: None when all, else a boolean (len(q_pos), len(k_pos)).

    Positions are global (the rows' places in the whole sequence), so a remote block is masked where it really
    lies: query i sees key j when j <= i + offset, with offset = m - n (``flashlab.reference.causal_mask``).
    """
    if not causal:
        return None
    return np.asarray(k_pos)[None, :] <= np.asarray(q_pos)[:, None] + offset


def step(state: online.State, q: np.ndarray, k: np.ndarray, v: np.ndarray, q_pos: np.ndarray, k_pos: np.ndarray,
         *, causal: bool = False, scale: float | None = None, offset: int = 0) -> online.State:
    """One device's step of the ring: fold the K/V block that just arrived into the state of its queries.

    q is (..., nq, d), k (..., mk, d), v (..., mk, dv); ``q_pos`` and ``k_pos`` are the global positions of their
    rows, ``offset`` = m - n of the whole attention (for the causal mask). The scores are masked with those global
    positions and folded in with :func:`flashlab.online.update`, which rescales what the state holds when the
    block raises the running max. An empty block, or one that no query may see, leaves the state unchanged.
    """
    if k.shape[-2] == 0 or q.shape[-2] == 0:  # a device with no rows (n < world) passes an empty block
        return state
    scale = check_scale(scale, q.shape[-1])
    scores = scale * (q @ np.swapaxes(k, -1, -2))
    seen = visible(q_pos, k_pos, causal=causal, offset=offset)
    if seen is not None:
        if not seen.any():
            return state
        scores = np.where(seen, scores, -np.inf)
    return online.update(state, scores, v)


def finish(state: online.State) -> tuple[np.ndarray, np.ndarray]:
    """The final merge of one device: (O, L) = (u / l, m + log l) of its queries; rows that saw no key get
    O = 0 and L = -inf."""
    return state.result(), state.logsumexp()


StepFn = Callable[..., online.State]


def run_device(rank: int, world: int, q: np.ndarray, own: tuple[np.ndarray, np.ndarray],
               send: Callable[[tuple[np.ndarray, np.ndarray]], None],
               receive: Callable[[], tuple[np.ndarray, np.ndarray]], positions: Sequence[tuple[np.ndarray, np.ndarray]],
               *, causal: bool = False, scale: float | None = None, offset: int = 0,
               fold: StepFn = step) -> tuple[np.ndarray, np.ndarray]:
    """Everything device ``rank`` does in the ring; returns (O_p, L_p) for its queries.

    ``own`` = (K_p, V_p); ``positions[p]`` = (query positions, key positions) of device p. Before folding a block
    it sends it on (``send``), so that the transfer overlaps the computation, then receives the next one
    (``receive``): world - 1 transfers, world folds, each block masked with the positions of the device it came
    from (:func:`source`). ``fold`` is the step (default :func:`step`).
    """
    q_pos = positions[rank][0]
    state = online.init(q.shape[:-1], v_dim(own[1]))
    block = own
    for s in range(world):
        if s < world - 1:
            send(block)
        k, v = block
        state = fold(state, q, k, v, q_pos, positions[source(rank, s, world)][1], causal=causal, scale=scale,
                     offset=offset)
        if s < world - 1:
            block = receive()
    return finish(state)


def v_dim(v: np.ndarray) -> int:
    """The value dimension dv of a (..., mk, dv) block."""
    return int(v.shape[-1])


# --------------------------------------------------------------------------------------------- load balance
def work(n: int, world: int, *, layout: str = "contiguous", causal: bool = True, m: int | None = None,
         tile: int = 1) -> dict[str, np.ndarray]:
    """The work of each device of the ring, counted from the mask.

    Returns ``{"pairs": (world,), "steps": (world, world), "tiles": (world,)}``: the (query, key) pairs each
    device scores (the FLOPs are 4 d times that), the pairs device p scores at step s (the ring moves in lock
    step, so a step lasts as long as its busiest device), and the tile x tile tiles with at least one visible pair
    (a kernel skips the others), tiles cut within each chunk the layout gives a device.
    """
    world = _check_world(world)
    m = n if m is None else m
    offset = causal_offset(n, m) if causal else None
    qs, ks = split(n, world, layout), split(m, world, layout)
    steps = np.zeros((world, world), dtype=np.int64)
    tiles = np.zeros(world, dtype=np.int64)
    for p in range(world):
        for s in range(world):
            for qr in _runs(qs[p]):
                for kr in _runs(ks[source(p, s, world)]):
                    steps[p, s] += _pairs(qr, kr, offset)
                    tiles[p] += _tiles(qr, kr, offset, tile)
    return {"pairs": steps.sum(axis=1), "steps": steps, "tiles": tiles}


def _runs(pos: np.ndarray) -> list[np.ndarray]:
    """The contiguous runs of a sorted position array (one per chunk of the layout)."""
    if pos.size == 0:
        return []
    cuts = np.flatnonzero(np.diff(pos) != 1) + 1
    return np.split(pos, cuts)


def _pairs(qr: np.ndarray, kr: np.ndarray, offset: int | None) -> int:
    """Visible pairs between a run of queries and a run of keys: query i sees the keys up to i + offset."""
    if offset is None:
        return qr.size * kr.size
    return int(np.clip(qr + offset - kr[0] + 1, 0, kr.size).sum())


def _tiles(qr: np.ndarray, kr: np.ndarray, offset: int | None, tile: int) -> int:
    """Tiles with a visible pair: those whose first key is visible to their last query."""
    q_tiles = -(-qr.size // tile)
    k_starts = kr[::tile]
    if offset is None:
        return q_tiles * k_starts.size
    last_q = qr[np.minimum(np.arange(1, q_tiles + 1) * tile, qr.size) - 1]
    return int(np.searchsorted(k_starts, last_q + offset, side="right").sum())


# ------------------------------------------------------------------------------------------------- the call
def attention(q, k, v, *, world: int = 2, causal: bool = False, scale: float | None = None,
              layout: str = "contiguous", backend: str = "cpu", timeout: float = 120.0, fold: StepFn = step,
              **gpu_options: Any) -> tuple[np.ndarray, np.ndarray]:
    """Attention computed by a ring of ``world`` devices. Returns ``(O, L)`` like ``flashlab.reference.attention``.

    q is (..., n, d), k (..., m, d), v (..., m, dv) NumPy arrays (K/V may have fewer heads, axis -3, as in the
    reference). The rows of Q and of K/V are shared out by ``layout`` (:func:`split`); ``causal`` masks as the
    reference does (query i sees key j when j <= i + m - n); ``scale`` defaults to 1/sqrt(d).

    ``backend``: ``"cpu"`` runs ``world`` worker processes (spawn) in float64 that pass K/V blocks round a ring of
    queues, each queue written by one device and read by the next; ``"threads"`` runs the same workers as threads;
    ``"gpu"`` runs one process per GPU (``world`` GPUs, fp16 inputs, d of 64 or 128; see
    :func:`flashlab.gpu.ring.attention` for ``gpu_options``). ``fold`` replaces the step of the CPU workers (a
    module-level function for ``"cpu"``, which pickles it). If a worker raises, dies or does not finish within
    ``timeout`` seconds, the others are stopped and :class:`RingError` says which and why.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}; got {backend!r}")
    world = _check_world(world)
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal must be True or False; got {causal!r}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}; got {layout!r}")
    if not (isinstance(timeout, (int, float)) and timeout > 0):
        raise ValueError(f"timeout must be a positive number of seconds; got {timeout!r}")
    if backend == "gpu":
        from .gpu import ring as gpu_ring

        return gpu_ring.attention(q, k, v, world=world, causal=causal, scale=scale, layout=layout,
                                  timeout=timeout, **gpu_options)
    if gpu_options:
        raise TypeError(f"unexpected arguments for backend {backend!r}: {sorted(gpu_options)}")
    Q, K, V = check_qkv(q, k, v, allow_gqa=True)
    Q, K, V = (x.astype(np.float64) for x in (Q, K, V))
    n, m = Q.shape[-2], K.shape[-2]
    scale = check_scale(scale, Q.shape[-1])
    q_rows, k_rows = split(n, world, layout), split(m, world, layout)
    positions = list(zip(q_rows, k_rows, strict=True))
    jobs = [(p, world, Q[..., q_rows[p], :], (K[..., k_rows[p], :], V[..., k_rows[p], :]), positions,
             dict(causal=bool(causal), scale=scale, offset=causal_offset(n, m), fold=fold)) for p in range(world)]
    results = _run_ring(jobs, backend=backend, timeout=float(timeout))
    O = np.zeros(Q.shape[:-1] + (V.shape[-1],))
    L = np.full(Q.shape[:-1], -np.inf)
    for p, (o, lse) in enumerate(results):
        O[..., q_rows[p], :] = o
        L[..., q_rows[p]] = lse
    return O, L


# ------------------------------------------------------------------------------------ workers and the ring
def _worker(rank: int, world: int, q, own, positions, options: dict, inbox, outbox, results, timeout: float) -> None:
    """One device: run the ring, put ("ok", rank, (O, L)) or ("error", rank, traceback) on ``results``."""
    try:
        def receive():
            try:
                return inbox.get(timeout=timeout)
            except queue.Empty:
                raise RingError(f"device {rank} received nothing from device {(rank - 1) % world} within "
                                f"{timeout:g} s") from None

        out = run_device(rank, world, q, own, outbox.put, receive, positions, **options)
        results.put(("ok", rank, out))
    except BaseException:  # noqa: BLE001 - whatever happened, the caller must hear of it instead of waiting
        results.put(("error", rank, traceback.format_exc()))


def _run_ring(jobs: list, *, backend: str, timeout: float) -> list:
    """Start one worker per job, neighbours joined by queues; collect (O_p, L_p) in rank order or raise."""
    world = len(jobs)
    if backend == "cpu":
        ctx = mp.get_context("spawn")
        inboxes = [ctx.Queue() for _ in range(world)]
    else:
        inboxes = [queue.Queue() for _ in range(world)]
    args = [(rank, w, q, own, positions, options, inboxes[rank], inboxes[(rank + 1) % world])
            for rank, w, q, own, positions, options in jobs]
    try:
        return run_workers(_worker, args, processes=backend == "cpu", timeout=timeout)
    finally:
        if backend == "cpu":
            for box in inboxes:
                box.cancel_join_thread()
                box.close()


def run_workers(target: Callable, args: Sequence[tuple], *, processes: bool, timeout: float) -> list:
    """Run ``target(*args[p], results, timeout)`` for every p, as spawned processes or as threads, and return what
    each put on ``results`` as ("ok", p, payload), in order of p. An ("error", p, text) message, a process that
    dies, or ``timeout`` seconds without every result raise :class:`RingError`; the other processes are stopped."""
    world = len(args)
    if processes:
        ctx = mp.get_context("spawn")
        results = ctx.Queue()
        make = ctx.Process
    else:
        results = queue.Queue()
        make = threading.Thread
    workers = [make(target=target, args=(*a, results, timeout), daemon=True) for a in args]
    try:
        for wk in workers:
            wk.start()
        return _collect(workers, results, world, timeout, processes)
    finally:
        if processes:
            for wk in workers:
                if wk.is_alive():
                    wk.terminate()
            for wk in workers:
                if wk.pid is not None:
                    wk.join(timeout=5)
            results.cancel_join_thread()
            results.close()


def _collect(workers, results, world: int, timeout: float, processes: bool) -> list:
    done: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    while len(done) < world:
        left = deadline - time.monotonic()
        if left <= 0:
            missing = sorted(set(range(world)) - set(done))
            raise RingError(f"ring attention timed out after {timeout:g} s: device(s) {missing} of {world} did not "
                            f"finish (a worker hangs or waits for a block that never comes)")
        try:
            status, rank, payload = results.get(timeout=min(left, 0.2))
        except queue.Empty:
            if processes:
                for rank, wk in enumerate(workers):
                    if rank not in done and wk.exitcode not in (None, 0):
                        raise RingError(f"device {rank} of {world} died (exit code {wk.exitcode}) before it "
                                        f"returned its rows") from None
            continue
        if status == "error":
            raise RingError(f"device {rank} of {world} failed:\n{payload}")
        done[rank] = payload
    return [done[p] for p in range(world)]


def flops_per_step(n: int, d: int, world: int, *, heads: int = 1) -> float:
    """FLOP of one ring step of non-causal attention on one device: 4 (n / P)^2 d per head."""
    return 4.0 * (n / world) ** 2 * d * heads


def block_bytes(n: int, d: int, world: int, *, heads: int = 1, bytes_per_value: int = 2) -> float:
    """Bytes one device sends per ring step: its K and V block, 2 (n / P) d values per head."""
    return 2.0 * (n / world) * d * heads * bytes_per_value


def step_model(n: int, d: int, world: int, *, tflops: float, link_gbs: float, heads: int = 1,
               bytes_per_value: int = 2) -> dict[str, float]:
    """The time of one ring step on paper: compute (:func:`flops_per_step` at ``tflops`` TFLOP/s) against
    communication (:func:`block_bytes` at ``link_gbs`` GB/s, 1 GB = 10^9 bytes), in seconds, and the total time of
    the P steps when the transfer hides under the computation wherever it can (each step lasts the longer of the
    two; the first block is local)."""
    compute = flops_per_step(n, d, world, heads=heads) / (tflops * 1e12)
    comm = block_bytes(n, d, world, heads=heads, bytes_per_value=bytes_per_value) / (link_gbs * 1e9)
    total = compute + (world - 1) * max(compute, comm)
    return {"compute_s": compute, "comm_s": comm, "total_s": total, "hidden": comm <= compute}


def crossover_n(d: int, world: int, *, tflops: float, link_gbs: float, bytes_per_value: int = 2) -> float:
    """The sequence length below which a step's transfer no longer hides under its compute: from
    4 (n/P)^2 d / F = 2 (n/P) d b / B, n = P F b / (2 B) (independent of d and of the number of heads)."""
    return world * (tflops * 1e12) * bytes_per_value / (2.0 * link_gbs * 1e9)


__all__ = ["LAYOUTS", "BACKENDS", "RingError", "split", "source", "visible", "step", "finish", "run_device",
           "work", "attention", "run_workers", "flops_per_step", "block_bytes", "step_model", "crossover_n"]
