"""A ring of shared-memory stages between a producer and consumers, guarded by mbarriers, simulated in Python.

Chapter 11's warp-specialised rung (kernels/hopper/h3_warp_specialized.cu) has one warpgroup copy key tiles into
``stages`` buffers and two warpgroups compute on them. Two mbarriers per stage carry the handshake: *full* (the
tile's bytes have landed) and *empty* (every consumer thread is done with the stage). An mbarrier counts
completed phases; ``try_wait(parity)`` is true once the phase of that parity has completed, which is all a waiter
can ask. :func:`ring_schedule` says which parity each wait of tile t needs; :func:`simulate` runs the protocol
under random interleavings and reports the first thing that goes wrong with a given schedule: a consumer reading a
stage before its tile landed or after the next one overwrote it, a copy into a stage still in use, or a deadlock.

Rung H4 (kernels/hopper/h4_overlap.cu) adds turns: its two consumers take turns at the tensor cores through named
barriers (ping-pong). :func:`pingpong_ops` lists each consumer's bar.sync, bar.arrive and products in order;
:func:`simulate_turns` runs such lists and reports a deadlock, an arrival left pending at the end, or products
issued outside a turn.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Sequence

import numpy as np


class MBarrier:
    """An mbarrier: ``count`` arrivals and the expected bytes complete a phase; phases are counted from 0."""

    def __init__(self, count: int) -> None:
        if count < 1:
            raise ValueError(f"an mbarrier expects at least one arrival; got count={count}")
        self.count, self.pending, self.tx, self.completed = count, count, 0, 0

    def arrive(self, expect_tx: int = 0) -> None:
        """One arrival, adding ``expect_tx`` bytes to what the current phase waits for (arrive.expect_tx)."""
        self.tx += expect_tx
        self.pending -= 1
        self._check()

    def complete_tx(self, nbytes: int) -> None:
        """The copy engine delivered ``nbytes`` of the current phase."""
        self.tx -= nbytes
        self._check()

    def _check(self) -> None:
        if self.pending == 0 and self.tx == 0:
            self.completed += 1
            self.pending = self.count

    def try_wait(self, parity: int) -> bool:
        """True once the phase of ``parity`` has completed: the phase in progress has the other parity."""
        return self.completed % 2 != parity % 2


@dataclasses.dataclass(frozen=True)
class Wait:
    """The waits of tile ``tile``: its stage, the parity of *full* its consumers wait for, and the parity of
    *empty* the producer waits for before copying it (None: the stage has never been used)."""

    tile: int
    stage: int
    full_parity: int
    empty_parity: int | None


def ring_schedule(tiles: int, stages: int) -> list[Wait]:
    """Tile t goes to stage t % stages. That stage's barriers have completed t // stages phases before tile t's
    own, so consumers wait for parity (t // stages) % 2 of *full*; the producer waits for the phase in which the
    consumers released tile t - stages, parity (t // stages - 1) % 2 of *empty*."""
    if tiles < 0 or stages < 1:
        raise ValueError(f"expected tiles >= 0 and stages >= 1; got tiles={tiles}, stages={stages}")
    return [Wait(t, t % stages, (t // stages) % 2, None if t < stages else (t // stages - 1) % 2)
            for t in range(tiles)]


@dataclasses.dataclass
class Outcome:
    ok: bool
    problem: str = ""
    steps: int = 0


def simulate(tiles: int, stages: int, consumers: int = 2, *, schedule: Callable[[int, int], list[Wait]] = ring_schedule,
             seed: int = 0, max_steps: int = 100_000) -> Outcome:
    """Run the producer, the copy engine and ``consumers`` consumers under a random interleaving (``seed``), each
    wait taken from ``schedule(tiles, stages)``. Returns the first violation, or ok when every consumer read every
    tile from its stage while it held that tile."""
    plan = schedule(tiles, stages)
    rng = random.Random(seed)
    full = [MBarrier(1) for _ in range(stages)]
    empty = [MBarrier(consumers) for _ in range(stages)]
    holds = [None] * stages  # the tile whose bytes have landed in each stage
    users = [set() for _ in range(stages)]  # consumers still computing on each stage
    in_flight: list[tuple[int, int]] = []  # (stage, tile) copies issued, not landed
    produced = 0
    consumed = [0] * consumers
    busy = [None] * consumers  # (stage, tile) a consumer computes on, or None
    for step in range(max_steps):
        if produced == tiles and all(c == tiles for c in consumed) and not in_flight:
            return Outcome(True, steps=step)
        actors = ["producer"] * (produced < tiles) + ["engine"] * bool(in_flight)
        actors += [f"consumer {i}" for i in range(consumers) if consumed[i] < tiles]
        progressed = False
        for actor in rng.sample(actors, len(actors)):
            if actor == "producer":
                w = plan[produced]
                if w.empty_parity is not None and not empty[w.stage].try_wait(w.empty_parity):
                    continue
                if users[w.stage]:
                    return Outcome(False, f"tile {produced} copied into stage {w.stage} while consumer(s) "
                                          f"{sorted(users[w.stage])} still compute on tile {holds[w.stage]}", step)
                full[w.stage].arrive(expect_tx=1)
                in_flight.append((w.stage, produced))
                holds[w.stage] = None
                produced += 1
            elif actor == "engine":
                stage, tile = in_flight.pop(rng.randrange(len(in_flight)))
                holds[stage] = tile
                full[stage].complete_tx(1)
            else:
                i = int(actor.split()[1])
                if busy[i] is not None:  # finish the tile: release the stage
                    stage, tile = busy[i]
                    if holds[stage] != tile:
                        return Outcome(False, f"consumer {i} computed on stage {stage} while tile {tile} was replaced",
                                       step)
                    users[stage].discard(i)
                    empty[stage].arrive()
                    busy[i] = None
                    consumed[i] += 1
                else:
                    w = plan[consumed[i]]
                    if not full[w.stage].try_wait(w.full_parity):
                        continue
                    if holds[w.stage] != consumed[i]:
                        held = "nothing yet" if holds[w.stage] is None else f"tile {holds[w.stage]}"
                        return Outcome(False, f"consumer {i} read stage {w.stage} for tile {consumed[i]}, which holds "
                                              f"{held}", step)
                    busy[i] = (w.stage, consumed[i])
                    users[w.stage].add(i)
            progressed = True
            break
        if not progressed:
            return Outcome(False, f"deadlock: producer at tile {produced}, consumers at {consumed}, every wait false",
                           step)
    return Outcome(False, f"no end after {max_steps} steps", max_steps)


# ------------------------------------------------------------------------------------ ping-pong: named barriers
# Rung H4 (kernels/hopper/h4_overlap.cu) makes its two consumer warpgroups take turns at the tensor cores: named
# barrier 1 + c means "consumer c may issue". Named barrier 0 is the one __syncthreads() uses for the whole block.
TURN_OPS = ("sync", "arrive")
NAMED_BARRIERS = 16  # bar.sync / bar.arrive take barriers 0 .. 15


def pingpong_ops(consumer: int, ntiles: int, my_tiles: int) -> list[tuple[str, int]]:
    """What consumer ``consumer`` (0 or 1) of rung H4 does with the named barriers and the tensor cores, in order.

    Consumer 1 first arrives once on barrier 1, so that consumer 0 takes the first turn. Both then take the turns
    t = 0 .. ntiles, each ``("sync", own barrier)``, the products of the turn — ``("S", t)`` for S_t = Q K_t^T when
    t < my_tiles, ``("PV", t - 1)`` for O += P_{t-1} V_{t-1} when 0 < t <= my_tiles — and ``("arrive", the other's
    barrier)``, except consumer 1's last turn, which hands over to no one. ``my_tiles`` (at most ``ntiles``, the
    block's key tiles) is where the consumer's causal rows end: its later turns are taken empty, so that every
    bar.sync has its bar.arrive.
    """
    for name, value in (("consumer", consumer), ("ntiles", ntiles), ("my_tiles", my_tiles)):
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
            raise TypeError(f"{name} must be an integer; got {value!r}")
    if consumer not in (0, 1) or not 0 <= my_tiles <= ntiles:
        raise ValueError(f"expected consumer 0 or 1 and 0 <= my_tiles <= ntiles; got consumer={consumer}, "
                         f"ntiles={ntiles}, my_tiles={my_tiles}")
    mine, other = 1 + consumer, 2 - consumer
    ops: list[tuple[str, int]] = [("arrive", 1)] if consumer == 1 else []
    for t in range(ntiles + 1):
        ops.append(("sync", mine))
        if t < my_tiles:
            ops.append(("S", t))
        if 0 < t <= my_tiles:
            ops.append(("PV", t - 1))
        if not (consumer == 1 and t == ntiles):
            ops.append(("arrive", other))
    return ops


def _checked_program(ops: Sequence, who: str) -> list[tuple[str, int]]:
    if isinstance(ops, (str, bytes)) or not isinstance(ops, Sequence):
        raise TypeError(f"{who}'s program must be a list of (name, number) ops; got {type(ops).__name__}")
    out = []
    for i, op in enumerate(ops):
        if isinstance(op, (str, bytes)) or not isinstance(op, Sequence) or len(op) != 2:
            raise ValueError(f"{who}'s op {i} is {op!r}: an op is a pair (name, number), e.g. ('sync', 1)")
        name, number = op
        if not isinstance(name, str) or not isinstance(number, (int, np.integer)) or isinstance(number, bool):
            raise ValueError(f"{who}'s op {i} is {op!r}: an op is a pair (name, number), e.g. ('sync', 1)")
        if name in TURN_OPS and not 0 <= number < NAMED_BARRIERS:
            raise ValueError(f"{who}'s op {i} is {op!r}: named barriers are 0 .. {NAMED_BARRIERS - 1}")
        out.append((name, int(number)))
    return out


def simulate_turns(programs: Sequence[Sequence[tuple[str, int]]], *, count: int = 2, seed: int = 0,
                   who: str = "consumer") -> Outcome:
    """Run the named-barrier programs of warpgroups (one list of ops each, e.g. :func:`pingpong_ops` of each
    consumer) under a random interleaving (``seed``), and report the first thing that goes wrong.

    ``("sync", b)`` is bar.sync: arrive at barrier b and wait until ``count`` warpgroups have arrived there (rung
    H4's count of 256 threads is its 2 consumer warpgroups); ``("arrive", b)`` is bar.arrive: arrive without
    waiting. When the count is reached the barrier completes, releases its waiters and starts counting afresh. Any
    other op ``(name, number)`` is work a warpgroup issues in its turn, which lasts from the completion of its
    bar.sync to its next barrier op. The problems: work issued outside a turn or while another warpgroup holds the
    turn, barrier 0 (``__syncthreads()``'s, for the whole block) used for turns, a deadlock (every warpgroup that
    has not finished waits at a bar.sync), and an arrival no bar.sync matched when every program has ended (the
    host emulation reports that at a block's end: the barrier would carry it into its next use).
    """
    if count < 1:
        raise ValueError(f"a barrier completes on at least one arrival; got count={count}")
    progs = [_checked_program(p, f"{who} {i}") for i, p in enumerate(programs)]
    rng = random.Random(seed)
    k = len(progs)
    pc, turn, holds = [0] * k, [0] * k, [False] * k
    waiting: list[int | None] = [None] * k
    arrived: dict[int, list[int]] = {}  # barrier -> warpgroups arrived in its current phase
    step = 0
    while True:
        ready = [i for i in range(k) if pc[i] < len(progs[i]) and waiting[i] is None]
        if not ready:
            blocked = [i for i in range(k) if waiting[i] is not None]
            if blocked:
                where = ", ".join(f"{who} {i} waits at bar.sync {waiting[i]} in its turn {turn[i] - 1} "
                                  f"({len(arrived[waiting[i]])} of {count} arrivals)" for i in blocked)
                done = [str(i) for i in range(k) if waiting[i] is None]
                gone = f"; {who} {', '.join(done)} has finished" if done else ""
                return Outcome(False, f"deadlock: {where}{gone}; the arrival each bar.sync waits for never comes",
                               step)
            left = {b: ids for b, ids in arrived.items() if ids}
            if left:
                b, ids = min(left.items())
                whose = " and ".join(f"{who} {i}" for i in ids)
                return Outcome(False, f"an arrival is left pending when the block ends: barrier {b} holds the "
                                      f"bar.arrive of {whose}, which no bar.sync matched", step)
            return Outcome(True, steps=step)
        i = rng.choice(ready)
        name, number = progs[i][pc[i]]
        pc[i] += 1
        step += 1
        if name in TURN_OPS:
            if number == 0:
                return Outcome(False, f"{who} {i} used named barrier 0 for its turns: barrier 0 is "
                                      "__syncthreads()'s, for every thread of the block", step)
            holds[i] = False
            arrived.setdefault(number, []).append(i)
            if name == "sync":
                waiting[i] = number
                turn[i] += 1
            if len(arrived[number]) == count:
                for j in range(k):
                    if waiting[j] == number:
                        waiting[j], holds[j] = None, True
                arrived[number] = []
            continue
        if not holds[i]:
            return Outcome(False, f"{who} {i} issued {name}_{number} outside its turn (no bar.sync of its own has "
                                  "completed since it last handed the turn over)", step)
        others = [j for j in range(k) if j != i and holds[j]]
        if others:
            return Outcome(False, f"{who} {i} issued {name}_{number} while {who} {others[0]} holds the turn", step)
