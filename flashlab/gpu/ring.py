"""Ring attention on several GPUs of one host: one process per GPU, K/V blocks sent through NCCL.

Each process owns one GPU and its share of the rows (``flashlab.ring.split``). Per step of the ring, the transfer
stream sends the K/V block the GPU holds to the next GPU and receives the previous GPU's block into the other
buffer (``ncclSend``/``ncclRecv`` in one group, through CuPy's ``cupy.cuda.nccl``), while the compute stream runs
the course's forward kernel (``flashlab.gpu.attention``, which returns each row's logsumexp) on the block it
holds. Each kernel call gives a partial (o, lse) over one block's keys, and chapter 1's merge folds it into the
running (o, lse) of the GPU's rows, in float32::

    lse = log(e^lse_a + e^lse_b),      o = e^(lse_a - lse) o_a + e^(lse_b - lse) o_b

Two buffers alternate: at step s the compute stream reads buffer s mod 2 while the transfer stream fills the
other, and an event on each side orders a buffer's reuse after its last reader. Nothing waits on the host until
the end, where the host polls the last events against a deadline: a peer that failed or vanished leaves an NCCL
call waiting for ever, so on timeout the communicator is aborted and the call raises ``flashlab.ring.RingError``.
NVLink SHARP multicast is kept off (``NCCL_NVLS_ENABLE=0``).

Causal masking with global positions: a block's mask is a band that the kernel's own causal convention (query a
sees key b when b <= a + mk - nq) covers once the rows and keys are cut to fit (:func:`pieces`), so the kernels
stay as they are.
"""

from __future__ import annotations

import os
import time
import traceback
from typing import Any

import numpy as np

from .. import ring as _ring
from .._checks import causal_offset, check_scale

NCCL_ENV = {"NCCL_NVLS_ENABLE": "0"}


def pieces(q_lo: int, nq: int, k_lo: int, mk: int, *, causal: bool, offset: int) -> list[tuple[int, int, int, bool]]:
    """How to cover one (query chunk, key chunk) pair with calls of a kernel that masks causally only from its
    own corner: a list of (row start, row end, number of keys from the chunk's start, causal) calls.

    Rows are [q_lo, q_lo + nq) and keys [k_lo, k_lo + mk) in global positions; query i sees key j when
    j <= i + offset. With delta = q_lo - k_lo + offset, local row a sees local key b when b <= a + delta: rows
    a >= mk - 1 - delta see the whole chunk (one plain call), the rows before see a prefix of it, which is the
    kernel's causal mask on those rows with kend = r + delta keys. An empty list: no row sees any key.
    """
    if not causal:
        return [(0, nq, mk, False)]
    delta = q_lo - k_lo + offset
    r = min(max(mk - 1 - delta, 0), nq)
    calls = []
    kend = r + delta
    if r > 0 and kend > 0:
        calls.append((0, r, kend, True))
    if r < nq:
        calls.append((r, nq, mk, False))
    return calls


def _cupy():
    import cupy

    return cupy


class DeviceRing:
    """One GPU's end of the ring: its communicator, a compute and a transfer stream, and the deadline."""

    def __init__(self, rank: int, world: int, uid: Any, timeout: float):
        cp = _cupy()
        from cupy.cuda import nccl

        self.cp, self.nccl = cp, nccl
        self.rank, self.world, self.timeout = rank, world, timeout
        cp.cuda.Device(rank).use()
        self.comm = nccl.NcclCommunicator(world, uid, rank) if world > 1 else None
        self.compute = cp.cuda.Stream(non_blocking=True)
        self.transfer = cp.cuda.Stream(non_blocking=True)

    def exchange(self, send_buf, recv_buf, stream) -> None:
        """Send ``send_buf`` to the next GPU and receive the previous GPU's block into ``recv_buf`` (bytes)."""
        nccl = self.nccl
        nxt, prv = (self.rank + 1) % self.world, (self.rank - 1) % self.world
        nccl.groupStart()
        byte = getattr(nccl, "NCCL_UINT8", 1)  # ncclUint8 is 1 in nccl.h
        self.comm.send(send_buf.data.ptr, send_buf.nbytes, byte, nxt, stream.ptr)
        self.comm.recv(recv_buf.data.ptr, recv_buf.nbytes, byte, prv, stream.ptr)
        nccl.groupEnd()

    def wait(self, event, what: str) -> None:
        """Poll ``event`` until it completes; past the deadline, abort the communicator and raise RingError."""
        deadline = time.monotonic() + self.timeout
        while not event.done:
            if time.monotonic() > deadline:
                if self.comm is not None:
                    self.comm.abort()
                raise _ring.RingError(f"GPU {self.rank} of {self.world}: {what} did not complete within "
                                      f"{self.timeout:g} s (a peer failed or stopped); the NCCL communicator was "
                                      "aborted")
            time.sleep(2e-4)

    def barrier(self) -> None:
        """All GPUs meet (a one-element all-reduce), with the deadline."""
        if self.comm is None:
            return
        cp = self.cp
        x = cp.zeros(1, dtype=cp.float32)
        self.comm.allReduce(x.data.ptr, x.data.ptr, 1, self.nccl.NCCL_FLOAT32, self.nccl.NCCL_SUM,
                            cp.cuda.get_current_stream().ptr)
        ev = cp.cuda.get_current_stream().record()
        self.wait(ev, "a barrier")


class Shard:
    """One GPU's rows: its query chunks and two K/V buffers, each a flat uint8 array holding a block's chunks."""

    def __init__(self, cp, q_chunks: list, q_pos: list[tuple[int, int]], block_shapes: list[list[tuple]],
                 k_pos: list[list[tuple[int, int]]], dtype, dv: int):
        self.cp, self.dtype = cp, np.dtype(dtype)
        self.q, self.q_pos, self.k_pos = q_chunks, q_pos, k_pos
        self.block_shapes = block_shapes  # per rank: the K chunk shapes of its block (V: same with dv)
        self.dv = dv
        capacity = max(self.block_bytes(r) for r in range(len(block_shapes)))
        self.buffers = [cp.empty(capacity, dtype=cp.uint8), cp.empty(capacity, dtype=cp.uint8)]
        self.o = [cp.zeros(c.shape[:-1] + (dv,), dtype=cp.float32) for c in q_chunks]
        self.lse = [cp.full(c.shape[:-1], -np.inf, dtype=cp.float32) for c in q_chunks]

    def block_bytes(self, rank: int) -> int:
        """Bytes of rank ``rank``'s block: its K and V chunks."""
        size = self.dtype.itemsize
        return sum(int(np.prod(s)) * size + int(np.prod(s[:-1])) * self.dv * size for s in self.block_shapes[rank])

    def views(self, buf, rank: int) -> list[tuple[Any, Any]]:
        """The (K, V) chunks of rank ``rank``'s block inside flat buffer ``buf``: contiguous views."""
        chunks, off = [], 0
        itemsize = self.dtype.itemsize
        for shape in self.block_shapes[rank]:
            vshape = shape[:-1] + (self.dv,)
            nk, nv = int(np.prod(shape)) * itemsize, int(np.prod(vshape)) * itemsize
            k = buf[off:off + nk].view(self.dtype).reshape(shape)
            v = buf[off + nk:off + nk + nv].view(self.dtype).reshape(vshape)
            chunks.append((k, v))
            off += nk + nv
        return chunks

    def reset(self) -> None:
        for o, lse in zip(self.o, self.lse, strict=True):
            o.fill(0)
            lse.fill(-np.inf)


def merge_into(xp, o_acc, lse_acc, o, lse) -> None:
    """Chapter 1's merge in (o, lse) form, in place: fold a partial (o, lse) over new keys into the accumulators.

    ``xp`` is CuPy (NumPy works too: the tests check the arithmetic on the CPU). Weights are measured against the
    larger lse, guarded so that rows where both are -inf stay o = 0, lse = -inf (``logaddexp`` of two -inf is nan
    in CuPy)."""
    mx = xp.maximum(lse_acc, lse)
    safe = xp.where(xp.isfinite(mx), mx, 0)
    wa = xp.exp(lse_acc - safe)
    wb = xp.exp(lse - safe)
    total = wa + wb
    o_acc *= (wa / xp.where(total > 0, total, 1))[..., None]
    o_acc += (wb / xp.where(total > 0, total, 1))[..., None] * o.astype(xp.float32)
    lse_acc[...] = xp.where(total > 0, safe + xp.log(xp.where(total > 0, total, 1)), -xp.inf)


def _contig(cp, x, axis_slice: slice):
    return cp.ascontiguousarray(x[..., axis_slice, :])


def fold_block(dr: DeviceRing, shard: Shard, kv_chunks: list, src: int, *, causal: bool, scale: float,
               offset: int, kernel: str, head_slab: int | None = None) -> None:
    """Attend every query chunk of the shard to one block's chunks and merge each partial into the accumulators
    (on the current stream). ``head_slab`` heads per kernel call (all by default; fewer bounds the partial's
    memory): a (1, H, n, d) array's heads are contiguous slabs, its rows are not."""
    from .. import gpu as fgpu

    cp = dr.cp
    for qi, q in enumerate(shard.q):
        q_lo, nq = shard.q_pos[qi]
        for (k, v), (k_lo, mk) in zip(kv_chunks, shard.k_pos[src], strict=True):
            for a0, a1, kend, cz in pieces(q_lo, nq, k_lo, mk, causal=causal, offset=offset):
                whole = a0 == 0 and a1 == nq
                qq = q if whole else _contig(cp, q, slice(a0, a1))
                kk, vv = (k, v) if kend == mk else (_contig(cp, k, slice(0, kend)), _contig(cp, v, slice(0, kend)))
                for h0, h1, g0, g1 in _slabs(qq, kk, head_slab):
                    o, lse = fgpu.attention(qq[:, h0:h1] if qq.ndim == 4 else qq,
                                            kk[:, g0:g1] if kk.ndim == 4 else kk,
                                            vv[:, g0:g1] if vv.ndim == 4 else vv, causal=cz, scale=scale, kernel=kernel)
                    o_acc, lse_acc = shard.o[qi], shard.lse[qi]
                    if qq.ndim == 4:
                        o_acc, lse_acc = o_acc[:, h0:h1], lse_acc[:, h0:h1]
                    if not whole:
                        o_acc, lse_acc = o_acc[..., a0:a1, :], lse_acc[..., a0:a1]
                    merge_into(cp, o_acc, lse_acc, o, lse)


def _slabs(q, k, head_slab: int | None) -> list[tuple[int, int, int, int]]:
    """(first head, end head, first K/V head, end K/V head) of each kernel call; one call for 2-D inputs."""
    if q.ndim != 4 or head_slab is None or head_slab >= q.shape[1] or q.shape[0] != 1:
        return [(0, q.shape[1] if q.ndim == 4 else 1, 0, k.shape[1] if k.ndim == 4 else 1)]
    H, Hk = q.shape[1], k.shape[1]
    group = H // Hk
    slab = max(group, head_slab // group * group)  # whole groups, so each call's K/V heads divide its heads
    return [(h, min(h + slab, H), h // group, min(h + slab, H) // group) for h in range(0, H, slab)]


def ring_forward(dr: DeviceRing, shard: Shard, *, causal: bool, scale: float, offset: int, kernel: str = "best",
                 compute: bool = True, transfer: bool = True, head_slab: int | None = None) -> None:
    """All steps of the ring on this GPU, launched on the current stream (the transfer stream joins it at the end).

    ``compute=False`` only passes the blocks round (communication alone); ``transfer=False`` computes every step on
    the GPU's own block (computation alone, same work): the benchmark's two halves of one step.
    """
    cp = dr.cp
    main = cp.cuda.get_current_stream()
    world, rank = dr.world, dr.rank
    shard.reset()
    ready = main.record()  # the own block is in buffer 0 and the accumulators are reset
    used = ready
    for s in range(world):
        src = _ring.source(rank, s, world)
        cur = shard.buffers[s % 2] if transfer else shard.buffers[0]  # without transfers only the own block is there
        if transfer and s < world - 1:
            dr.transfer.wait_event(used)  # the other buffer's last reader (step s - 1's compute) is done
            dr.transfer.wait_event(ready)
            nbytes = shard.block_bytes(src)
            nxt_bytes = shard.block_bytes(_ring.source(rank, s + 1, world))
            dr.exchange(cur[:nbytes], shard.buffers[(s + 1) % 2][:nxt_bytes], dr.transfer)
            arrived = dr.transfer.record()
        if compute:
            chunks = shard.views(cur, src if transfer else rank)
            fold_block(dr, shard, chunks, src if transfer else rank, causal=causal, scale=scale, offset=offset,
                       kernel=kernel, head_slab=head_slab)
        used = main.record()
        if transfer and s < world - 1:
            main.wait_event(arrived)
            ready = arrived


# ------------------------------------------------------------------------------------------- worker processes
def _layout_chunks(rows: np.ndarray) -> list[tuple[int, int]]:
    """(start, length) of each contiguous run of a device's rows."""
    return [(int(r[0]), int(r.size)) for r in _ring._runs(rows)]


def _upload_shard(cp, rank: int, q_chunks_np: list, kv_np: list, q_pos, k_pos, block_shapes, dv: int) -> Shard:
    q_chunks = [cp.asarray(c) for c in q_chunks_np]
    dtype = q_chunks[0].dtype if q_chunks else np.dtype(np.float16)
    shard = Shard(cp, q_chunks, q_pos, block_shapes, k_pos, dtype, dv)
    for (k, v), (kv, vv) in zip(shard.views(shard.buffers[0], rank), kv_np, strict=True):
        k.set(np.ascontiguousarray(kv))
        v.set(np.ascontiguousarray(vv))
    return shard


def _attention_worker(rank: int, world: int, uid, task: dict, results, timeout: float) -> None:
    """One GPU: upload its rows, run the ring once, return (o chunks, lse chunks) as NumPy arrays."""
    try:
        dr = DeviceRing(rank, world, uid, timeout)
        cp = dr.cp
        with dr.compute:
            shard = _upload_shard(cp, rank, task["q"], task["kv"], task["q_pos"], task["k_pos"],
                                  task["block_shapes"], task["dv"])
            dr.barrier()
            ring_forward(dr, shard, causal=task["causal"], scale=task["scale"], offset=task["offset"],
                         kernel=task["kernel"])
            dr.wait(dr.compute.record(), "the ring")
            dr.barrier()
            out = ([o.get() for o in shard.o], [lse.get() for lse in shard.lse])
        results.put(("ok", rank, out))
    except BaseException:  # noqa: BLE001 - the caller must hear of any failure instead of waiting
        results.put(("error", rank, traceback.format_exc()))


def attention(q, k, v, *, world: int = 2, causal: bool = False, scale: float | None = None,
              layout: str = "contiguous", timeout: float = 120.0, kernel: str = "best"):
    """Ring attention over ``world`` GPUs of this host; called as ``flashlab.ring.attention(..., backend="gpu")``.

    q (n, d) or (batch, heads, n, d), k and v (m, d) or (batch, heads, m, d): NumPy float16 arrays (converted
    otherwise), d of 64 or 128. GPU p gets the rows ``flashlab.ring.split`` gives device p. Returns NumPy
    (O float32, L float32), shaped like the reference's. ``kernel`` names the forward rung (default "best").
    """
    Q, K, V = (np.ascontiguousarray(x, dtype=np.float16) for x in (q, k, v))
    if not (Q.ndim == K.ndim == V.ndim and Q.ndim in (2, 4)):
        raise ValueError(f"q, k, v must all be (n, d) or (batch, heads, n, d); got {Q.shape}, {K.shape}, {V.shape}")
    n, m, d = Q.shape[-2], K.shape[-2], Q.shape[-1]
    if K.shape[-1] != d or K.shape[:-1] != V.shape[:-1] or V.shape[-1] != d:
        raise ValueError(f"k must be (..., m, d) and v (..., m, d) with q's d; got {Q.shape}, {K.shape}, {V.shape}")
    cp = _cupy()
    if cp.cuda.runtime.getDeviceCount() < world:
        raise ValueError(f"world={world} needs {world} GPUs; this host has {cp.cuda.runtime.getDeviceCount()}")
    scale = check_scale(scale, d)
    q_rows, k_rows = _ring.split(n, world, layout), _ring.split(m, world, layout)
    q_pos = [_layout_chunks(r) for r in q_rows]
    k_pos = [_layout_chunks(r) for r in k_rows]
    block_shapes = [[K.shape[:-2] + (ln, d) for _, ln in kp] for kp in k_pos]
    from cupy.cuda import nccl

    for key, value in NCCL_ENV.items():
        os.environ.setdefault(key, value)  # the workers inherit it
    uid = nccl.get_unique_id()
    args = []
    for p in range(world):
        task = {"q": [np.ascontiguousarray(Q[..., lo:lo + ln, :]) for lo, ln in q_pos[p]],
                "kv": [(np.ascontiguousarray(K[..., lo:lo + ln, :]), np.ascontiguousarray(V[..., lo:lo + ln, :]))
                       for lo, ln in k_pos[p]],
                "q_pos": q_pos[p], "k_pos": k_pos, "block_shapes": block_shapes, "dv": d,
                "causal": bool(causal), "scale": scale, "offset": causal_offset(n, m), "kernel": kernel}
        args.append((p, world, uid, task))
    outs = _ring.run_workers(_attention_worker, args, processes=True, timeout=timeout)
    O = np.zeros(Q.shape, dtype=np.float32)
    L = np.full(Q.shape[:-1], -np.inf, dtype=np.float32)
    for p, (os_, ls_) in enumerate(outs):
        for (lo, ln), o, lse in zip(q_pos[p], os_, ls_, strict=True):
            O[..., lo:lo + ln, :] = o
            L[..., lo:lo + ln] = lse
    return O, L
