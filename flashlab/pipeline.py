"""A ring of shared-memory stages between a producer and consumers, guarded by mbarriers, simulated in Python.

Chapter 11's warp-specialised rung (kernels/hopper/h3_warp_specialized.cu) has one warpgroup copy key tiles into
``stages`` buffers and two warpgroups compute on them. Two mbarriers per stage carry the handshake: *full* (the
tile's bytes have landed) and *empty* (every consumer thread is done with the stage). An mbarrier counts
completed phases; ``try_wait(parity)`` is true once the phase of that parity has completed, which is all a waiter
can ask. :func:`ring_schedule` says which parity each wait of tile t needs; :func:`simulate` runs the protocol
under random interleavings and reports the first thing that goes wrong with a given schedule: a consumer reading a
stage before its tile landed or after the next one overwrote it, a copy into a stage still in use, or a deadlock.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable


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
