"""Lab 11 — Hopper's handshakes: the mbarrier ring, the ping-pong turns, and the stages that fit.

q1 ``ring_schedule(tiles, stages) -> [(stage, full_parity, empty_parity), ...]``: the waits of chapter 11's
warp-specialised ring (rung H3), one entry per key tile: its stage t mod S, the parity of *full* its consumers wait
for, (t // S) mod 2, and the parity of *empty* the producer waits for before copying it, (t // S - 1) mod 2, or None
for the first S tiles (the stage has never been used). Checked tile by tile against ``flashlab.pipeline``, then run
through ``pipeline.simulate`` (a producer, a copy engine landing out of order and two consumers, under random
interleavings), whose report says what a wrong wait breaks.

q2 ``pingpong_ops(consumer, ntiles, my_tiles) -> [("sync", b) | ("arrive", b) | ("S", t) | ("PV", t), ...]``:
everything consumer 0 or 1 of rung H4 does with the named barriers and the tensor cores, in order (barrier 1 + c
means "consumer c may issue"). Checked op by op, for whole blocks and for consumers whose causal rows end early,
then both consumers' lists are run through ``pipeline.simulate_turns`` (deadlocks, arrivals left pending,
products issued outside a turn).

q3 ``stages_that_fit(d, block_rows, key_tile, smem_limit) -> S``: the most stages of K and V tiles rung H4's
shared-memory layout can hold in ``smem_limit`` bytes: a Q tile, S stages of a K and a V tile (2 bytes an
element), 1024 bytes to align the 128-byte swizzle's atoms, and 8 bytes for each mbarrier (Q's, then K full,
V full and empty per stage).

Everything is graded on the CPU.
"""

from __future__ import annotations

import numpy as np

from .. import pipeline
from .core import BadReturn, Case, Lab, Mutant, NotImplementedYet, Trial
from .known import Demo, KnownMistakes

LAB = Lab("lab11", "Hopper's handshakes: the mbarrier ring, the ping-pong turns, the stages that fit")

# Graded on the CPU only: the pipeline simulations and a byte count (nothing here launches a kernel).
NEEDS_GPU = False

# The course's own answers to each question (flashlab.grading.answers): calling one scores 0. The simulators
# (pipeline.simulate, pipeline.simulate_turns) are not answers: the lab's own cells run them on the learner's lists.
ANSWERS = {
    "q1": ("flashlab.pipeline.ring_schedule", "flashlab.grading.lab11._schedule"),
    "q2": ("flashlab.pipeline.pingpong_ops", "flashlab.grading.lab11._pingpong"),
    "q3": ("flashlab.grading.lab11._stages_that_fit", "flashlab.grading.lab11._ring_bytes"),
}

# Rung H4's layout (kernels/hopper/h4_overlap.cu): the dynamic shared memory is only 16-byte aligned and Q's tile
# starts at the next 1024-byte boundary (a swizzle atom: 8 rows of 128 bytes), so the host reserves 1024 bytes more.
ALIGN_SLACK = 1024
BARRIER_BYTES = 8  # one mbarrier is a 64-bit word
ELEMENT_BYTES = 2  # fp16 or bf16 tiles
# Every consumer op of q2, and the number that stands for it in the arrays the grader compares.
OP_CODES = {"sync": 0, "arrive": 1, "S": 2, "PV": 3}
_OP_NAMES = {code: name for name, code in OP_CODES.items()}


# ------------------------------------------------------------------------------------------- truth and helpers
def _schedule(tiles, stages):
    return [(w.stage, w.full_parity, w.empty_parity) for w in pipeline.ring_schedule(int(tiles), int(stages))]


def _pingpong(consumer, ntiles, my_tiles, *, first_arrive=True, last_arrive=False, ids=(1, 2), handover="after",
              past_end=False, pv_same_turn=False, silent_last=1):
    """Consumer ``consumer``'s ops with switches, one per known mistake; the defaults give rung H4's (those of
    ``pipeline.pingpong_ops``, the truth)."""
    mine, other = ids[consumer], ids[1 - consumer]
    ops = [("arrive", ids[0])] if consumer == 1 and first_arrive else []
    products = ntiles if past_end else my_tiles
    for t in range(ntiles + 1):
        ops.append(("sync", mine))
        if handover == "before" and not (consumer == silent_last and t == ntiles and not last_arrive):
            ops.append(("arrive", other))
        if pv_same_turn:
            ops += [("S", t), ("PV", t)] if t < products else []
        else:
            ops += [("S", t)] if t < products else []
            ops += [("PV", t - 1)] if 0 < t <= products else []
        if handover == "after" and not (consumer == silent_last and t == ntiles and not last_arrive):
            ops.append(("arrive", other))
    return ops


def _ring_bytes(d, block_rows, key_tile, stages):
    tiles = (block_rows + 2 * stages * key_tile) * d * ELEMENT_BYTES
    return tiles + ALIGN_SLACK + BARRIER_BYTES * (1 + 3 * stages)


def _stages_that_fit(d, block_rows, key_tile, smem_limit):
    fixed = _ring_bytes(d, block_rows, key_tile, 0)
    per_stage = _ring_bytes(d, block_rows, key_tile, 1) - fixed
    return max(0, (smem_limit - fixed) // per_stage)


# What the learner's function returned is checked before it is compared: a malformed list is reported as
# BadReturn, which the feedback prints as "your code returned ... instead of <the output's name>".
def _short(x) -> str:
    text = repr(x)
    return text if len(text) <= 80 else text[:77] + "..."


def _whole(x, what: str) -> int:
    """``x`` as an int, when it is a whole number (an int, a NumPy integer, or a float such as 2.0)."""
    if isinstance(x, (int, np.integer)):
        return int(x)
    if isinstance(x, (float, np.floating)) and np.isfinite(x) and float(x).is_integer():
        return int(x)
    raise BadReturn(f"returned a list in which {what} is {_short(x)} ({type(x).__name__}), not a whole number,")


def _entries(out, what: str) -> list:
    """The entries of a returned list (or tuple, or 2-D array), or BadReturn saying what was expected."""
    if isinstance(out, np.ndarray) and out.ndim == 2:
        return out.tolist()
    if isinstance(out, (str, bytes)) or not isinstance(out, (list, tuple)):
        raise BadReturn(f"returned {_short(out)} ({type(out).__name__}), not a list of {what},")
    return list(out)


def _schedule_rows(out) -> np.ndarray:
    """A schedule as a (tiles, 3) array: stage, full parity, empty parity (nan for None)."""
    rows = []
    for t, entry in enumerate(_entries(out, "(stage, full_parity, empty_parity), one per tile")):
        if isinstance(entry, (str, bytes)) or not isinstance(entry, (list, tuple)) or len(entry) != 3:
            raise BadReturn(f"returned a list whose entry {t} is {_short(entry)}, not (stage, full_parity, "
                            "empty_parity),")
        stage, full, empty = entry
        rows.append((_whole(stage, f"tile {t}'s stage"), _whole(full, f"tile {t}'s full parity"),
                     np.nan if empty is None else _whole(empty, f"tile {t}'s empty parity")))
    return np.array(rows, dtype=float).reshape(len(rows), 3)


def _ops_rows(out) -> np.ndarray:
    """A consumer's ops as a (number of ops, 2) array: the op's code (OP_CODES), then its barrier or tile."""
    rows = []
    for i, op in enumerate(_entries(out, "ops such as ('sync', 1)")):
        if (isinstance(op, (str, bytes)) or not isinstance(op, (list, tuple)) or len(op) != 2
                or not isinstance(op[0], str) or op[0] not in OP_CODES):
            raise BadReturn(f"returned a list whose op {i} is {_short(op)}, not ('sync', barrier), ('arrive', "
                            "barrier), ('S', tile) or ('PV', tile),")
        rows.append((OP_CODES[op[0]], _whole(op[1], f"op {i}'s number")))
    return np.array(rows, dtype=float).reshape(len(rows), 2)


def _failure(e: Exception) -> str:
    """What went wrong when the learner's function was called, for a part's feedback."""
    if isinstance(e, BadReturn):
        return f"your code {str(e).rstrip(',')}"
    return f"your code raised {type(e).__name__}: {e}"[:300]


def _run_schedule(fn, case: Case):
    return _schedule_rows(fn(*case.args))


def _run_ops(fn, case: Case):
    return _ops_rows(fn(*case.args))


def _as_program(rows: np.ndarray) -> list[tuple[str, int]]:
    return [(_OP_NAMES[int(code)], int(number)) for code, number in rows]


# --------------------------------------------------------------------------------------------- q1 mutants
def _schedule_full_t_mod_2(tiles, stages):
    return [(t % stages, t % 2, e) for t, (_, _, e) in enumerate(_schedule(tiles, stages))]


def _schedule_full_late(tiles, stages):
    return [(s, 1 - f, e) for s, f, e in _schedule(tiles, stages)]


def _schedule_empty_own_phase(tiles, stages):
    return [(s, f, None if e is None else f) for s, f, e in _schedule(tiles, stages)]


def _schedule_no_empty(tiles, stages):
    return [(s, f, None) for s, f, _ in _schedule(tiles, stages)]


def _schedule_empty_first_1(tiles, stages):
    return [(s, f, ((t // stages) + 1) % 2) for t, (s, f, _) in enumerate(_schedule(tiles, stages))]


def _schedule_empty_first_0(tiles, stages):
    return [(s, f, 0 if e is None else e) for s, f, e in _schedule(tiles, stages)]


def _schedule_two_stages(tiles, stages):
    return [(t % 2, f, e) for t, (_, f, e) in enumerate(_schedule(tiles, stages))]


SCHEDULE_MUTANTS = [
    Mutant("the full parity is t mod 2: a stage's barrier completes one phase per tile of that stage, and tile t is "
           "the (t // S)-th tile of stage t mod S, so its consumers wait for parity (t // S) mod 2.",
           fn=_schedule_full_t_mod_2),
    Mutant("the full parity is one phase late: before tile t's bytes land, stage t mod S's full barrier has completed "
           "t // S phases, so tile t's phase is number t // S and its parity (t // S) mod 2; the other parity is "
           "the phase before, already complete, so the consumers would read the stage before the tile lands.",
           fn=_schedule_full_late),
    Mutant("the producer waits for the empty phase its own copy will need: before copying tile t it must wait for "
           "the consumers' release of tile t - S, the phase of parity (t // S - 1) mod 2; parity (t // S) mod 2 is "
           "either the phase before that one, long complete (the copy overwrites a stage in use), or one that only "
           "the release of tile t itself completes (a deadlock).", fn=_schedule_empty_own_phase),
    Mutant("the producer never waits for empty: tile t then overwrites tile t - S while a consumer may still compute "
           "on it; for t >= S wait for parity (t // S - 1) mod 2 of the stage's empty barrier.",
           fn=_schedule_no_empty),
    Mutant("the first S tiles wait for parity 1 of empty: that wait would pass at once (a fresh mbarrier reports the "
           "phase before its first as complete), but the kernel skips it; the stage of tiles 0 .. S - 1 has never "
           "been used, so their empty parity is None.", fn=_schedule_empty_first_1),
    Mutant("the first S tiles wait for parity 0 of empty: no consumer has released those stages yet, so phase 0 of "
           "empty never completes before the copy (a deadlock); the stage of tiles 0 .. S - 1 has never been used: "
           "no wait (None).", fn=_schedule_empty_first_0),
    Mutant("the stage is t mod 2: that was rung H2's double buffer; with a ring of S stages tile t goes to stage "
           "t mod S.", fn=_schedule_two_stages),
]

SCHEDULE_ARGS = ("tiles", "stages")
SCHEDULE_NAMES = ("schedule (rows: stage, full parity, empty parity; nan for None)",)
# The rings the simulation runs, and how many interleavings of each: fixed, so that a schedule scores the same on
# every seed (the test of every mistake's report, tests/test_lab11.py, shows each wrong wait breaks them).
SIMULATED_RINGS = ((8, 2), (9, 3))
INTERLEAVINGS = 30


def _simulated(t: Trial, ring_schedule) -> tuple[bool, str]:
    """Whether the learner's schedule survives the simulated ring, and what broke when it did not."""
    for tiles, stages in SIMULATED_RINGS:
        where = f"with {tiles} tiles in {stages} stages and two consumers"
        try:
            rows = _schedule_rows(t.call(ring_schedule, tiles, stages))
        except NotImplementedYet:
            raise
        except Exception as e:  # the learner's bug: feedback
            return False, f"not simulated {where}: {_failure(e)}"
        problem = ""
        if len(rows) != tiles:
            problem = f"it returned {len(rows)} entries for {tiles} tiles"
        elif not np.isin(rows[:, 0], np.arange(stages)).all():
            problem = f"a stage outside 0 .. {stages - 1}: {rows[:, 0].astype(int).tolist()}"
        elif not (np.isin(rows[:, 1], (0, 1)) & (np.isnan(rows[:, 2]) | np.isin(rows[:, 2], (0, 1)))).all():
            problem = "a parity that is not 0 or 1"
        if problem:
            return False, f"not simulated {where}: {problem}"
        waits = [pipeline.Wait(i, int(s), int(f), None if np.isnan(e) else int(e)) for i, (s, f, e) in enumerate(rows)]
        runs = [pipeline.simulate(tiles, stages, 2, schedule=lambda *_, w=waits: w, seed=s)
                for s in range(INTERLEAVINGS)]
        bad = [(s, r.problem) for s, r in enumerate(runs) if not r.ok]
        if bad:
            seed, problem = bad[0]
            return False, (f"the simulated ring {where} went wrong in {len(bad)} of {INTERLEAVINGS} interleavings; "
                           f"the first (pipeline.simulate(..., seed={seed})): {problem}")
    return True, ""


@LAB.question("q1", points=4, objects=("ring_schedule",))
def q1(t: Trial, ring_schedule) -> None:
    """ring_schedule(tiles, stages) -> [(stage, full_parity, empty_parity), ...], one entry per tile."""
    ref = lambda c: _schedule_rows(_schedule(*c.args))  # noqa: E731
    cases = [Case((8, 3), "chapter 11's ring: 8 tiles, 3 stages", names=SCHEDULE_ARGS)]
    for _ in range(5):
        stages = int(t.rng.integers(2, 5))
        tiles = int(t.rng.integers(2 * stages + 1, 4 * stages + 3))
        cases.append(Case((tiles, stages), f"{tiles} tiles, {stages} stages", names=SCHEDULE_ARGS))
    t.compare("rings of 2 to 4 stages", 2, student=ring_schedule, cases=cases, reference=ref, run=_run_schedule,
              mutants=SCHEDULE_MUTANTS, names=SCHEDULE_NAMES)
    one = int(t.rng.integers(3, 7))
    few = int(t.rng.integers(2, 5))  # from 2 tiles: tile 1 tells (t // S) mod 2 from t mod 2
    edges = [Case((one, 1), f"{one} tiles, one stage", names=SCHEDULE_ARGS),
             Case((few, few + int(t.rng.integers(1, 3))), f"{few} tiles, more stages than tiles", names=SCHEDULE_ARGS),
             Case((0, 2), "no tile (a block whose rows see no key)", names=SCHEDULE_ARGS)]
    t.compare("one stage, more stages than tiles, no tile", 1, student=ring_schedule, cases=edges, reference=ref,
              run=_run_schedule, mutants=SCHEDULE_MUTANTS, names=SCHEDULE_NAMES)
    ok, hint = _simulated(t, ring_schedule)
    rings = " and ".join(f"{n} tiles in {s} stages" for n, s in SIMULATED_RINGS)
    t.expect(f"the simulated ring runs your schedule ({rings}, {INTERLEAVINGS} interleavings each)", 1, ok, hint)


# --------------------------------------------------------------------------------------------- q2 mutants
def _pp_no_first_arrive(consumer, ntiles, my_tiles):
    return _pingpong(consumer, ntiles, my_tiles, first_arrive=False)


def _pp_last_arrive_too(consumer, ntiles, my_tiles):
    return _pingpong(consumer, ntiles, my_tiles, last_arrive=True)


def _pp_stops_at_causal_end(consumer, ntiles, my_tiles):
    return _pingpong(consumer, my_tiles, my_tiles)


def _pp_ids_swapped(consumer, ntiles, my_tiles):
    return _pingpong(consumer, ntiles, my_tiles, ids=(2, 1))


def _pp_ids_from_zero(consumer, ntiles, my_tiles):
    return _pingpong(consumer, ntiles, my_tiles, ids=(0, 1))


def _pp_hands_over_first(consumer, ntiles, my_tiles):
    return _pingpong(consumer, ntiles, my_tiles, handover="before")


def _pp_products_past_end(consumer, ntiles, my_tiles):
    return _pingpong(consumer, ntiles, my_tiles, past_end=True)


def _pp_pv_same_turn(consumer, ntiles, my_tiles):
    return _pingpong(consumer, ntiles, my_tiles, pv_same_turn=True)


def _pp_consumer0_silent_last(consumer, ntiles, my_tiles):
    return _pingpong(consumer, ntiles, my_tiles, silent_last=0)


PINGPONG_MUTANTS = [
    Mutant("consumer 1 does not arrive on barrier 1 before its first turn: consumer 0's first bar.sync on barrier 1 "
           "then waits for an arrival that never comes, while consumer 1 waits on barrier 2 (a deadlock); consumer 1 "
           "arrives once on barrier 1 first, so that consumer 0 goes first.", fn=_pp_no_first_arrive),
    Mutant("consumer 1 hands the turn over after its last turn too: that bar.arrive on barrier 1 is matched by no "
           "bar.sync (consumer 0 has finished) and is left pending when the block ends; the very last turn of the "
           "block, consumer 1's turn ntiles, hands over to no one.", fn=_pp_last_arrive_too),
    Mutant("a consumer stops taking turns at its causal end: the other consumer's next bar.sync then waits for a "
           "bar.arrive that never comes (a deadlock); both take all ntiles + 1 turns, and past my_tiles a turn "
           "issues nothing.", fn=_pp_stops_at_causal_end),
    Mutant("the barrier numbers are swapped: barrier 1 + c means 'consumer c may issue', so consumer c waits "
           "(bar.sync) on barrier 1 + c and hands over (bar.arrive) on barrier 2 - c; consumer 1's first arrival "
           "goes on barrier 1.", fn=_pp_ids_swapped),
    Mutant("the barriers are numbered from 0: named barrier 0 is the one __syncthreads() uses for all the block's "
           "threads; consumer c's barrier is 1 + c.", fn=_pp_ids_from_zero),
    Mutant("the turn is handed over before the products are issued: the other consumer's bar.sync completes at once "
           "and both issue together; issue S_t and P_{t-1} V_{t-1}, then bar.arrive on the other's barrier.",
           fn=_pp_hands_over_first),
    Mutant("products are issued past the consumer's causal end: for t >= my_tiles every key of tile t is masked for "
           "this consumer's rows, so S_t and P_t V_t are skipped; those turns are taken empty.",
           fn=_pp_products_past_end),
    Mutant("turn t issues P_t V_t: P_t comes from the softmax of S_t, which runs after turn t's products are "
           "issued; turn t issues S_t and then P_{t-1} V_{t-1}, packed in the turn before, so that product runs "
           "under S_t's softmax (and turn ntiles issues the last one).", fn=_pp_pv_same_turn),
    Mutant("consumer 0's last turn hands over to no one: consumer 1 then waits forever for its own last turn; the "
           "turn with no one to hand over to is consumer 1's turn ntiles, the last of the block.",
           fn=_pp_consumer0_silent_last),
]

PINGPONG_ARGS = ("consumer", "ntiles", "my_tiles")
PINGPONG_NAMES = ("ops (one row per op: 0 = sync, 1 = arrive, 2 = S, 3 = PV; then its barrier or tile)",)
# Blocks the simulation runs: (ntiles, consumer 0's my_tiles, consumer 1's my_tiles). In rung H4 consumer 1 holds
# the block's later rows, so its causal rows end last: at the block's own end.
SIMULATED_BLOCKS = ((3, 3, 3), (4, 2, 4), (2, 0, 2), (0, 0, 0))
TURN_INTERLEAVINGS = 10


def _turns_simulated(t: Trial, pingpong_ops) -> tuple[bool, str]:
    """Whether both consumers' ops run through the named-barrier simulation, and what broke when they did not."""
    for ntiles, mine0, mine1 in SIMULATED_BLOCKS:
        where = (f"with ntiles = {ntiles}, consumer 0's rows ending after {mine0} tiles and consumer 1's after "
                 f"{mine1}")
        try:
            programs = [_as_program(_ops_rows(t.call(pingpong_ops, c, ntiles, mine)))
                        for c, mine in ((0, mine0), (1, mine1))]
        except NotImplementedYet:
            raise
        except Exception as e:  # the learner's bug: feedback
            return False, f"not simulated {where}: {_failure(e)}"
        try:
            runs = [pipeline.simulate_turns(programs, seed=s) for s in range(TURN_INTERLEAVINGS)]
        except ValueError as e:  # a barrier number no bar.sync takes
            return False, f"not simulated {where}: {e}"
        bad = [r.problem for r in runs if not r.ok]
        if bad:
            return False, f"the simulated block {where} went wrong: {bad[0]}"
    return True, ""


@LAB.question("q2", points=4, objects=("pingpong_ops",))
def q2(t: Trial, pingpong_ops) -> None:
    """pingpong_ops(consumer, ntiles, my_tiles) -> consumer's named-barrier ops and products, in order."""
    ref = lambda c: _ops_rows(pipeline.pingpong_ops(*c.args))  # noqa: E731
    whole = [Case((c, 2, 2), f"consumer {c}, a block of 2 tiles", names=PINGPONG_ARGS) for c in (0, 1)]
    whole.append(Case((1, 0, 0), "consumer 1, a block whose rows see no key", names=PINGPONG_ARGS))
    for c in (0, 1, int(t.rng.integers(0, 2))):
        n = int(t.rng.integers(3, 7))
        whole.append(Case((c, n, n), f"consumer {c}, a block of {n} tiles", names=PINGPONG_ARGS))
    t.compare("whole blocks, both consumers", 2, student=pingpong_ops, cases=whole, reference=ref, run=_run_ops,
              mutants=PINGPONG_MUTANTS, names=PINGPONG_NAMES)
    causal = [Case((0, 3, 1), "consumer 0, its causal rows end after tile 0 of 3", names=PINGPONG_ARGS),
              Case((0, 2, 0), "consumer 0, its rows see no key of the block's 2 tiles", names=PINGPONG_ARGS)]
    for c in (0, 1):
        n = int(t.rng.integers(3, 7))
        mine = int(t.rng.integers(1, n))
        causal.append(Case((c, n, mine), f"consumer {c}, its causal rows end after {mine} of {n} tiles",
                           names=PINGPONG_ARGS))
    t.compare("consumers whose causal rows end early", 1, student=pingpong_ops, cases=causal, reference=ref,
              run=_run_ops, mutants=PINGPONG_MUTANTS, names=PINGPONG_NAMES)
    ok, hint = _turns_simulated(t, pingpong_ops)
    t.expect(f"both consumers' ops run through the named-barrier simulation ({len(SIMULATED_BLOCKS)} blocks)", 1,
             ok, hint)


# --------------------------------------------------------------------------------------------- q3 mutants
def _fit_with(bytes_of):
    def fit(d, block_rows, key_tile, smem_limit):
        stages = 0
        while bytes_of(d, block_rows, key_tile, stages + 1) <= smem_limit:
            stages += 1
        return stages
    return fit


def _bytes_no_v(d, block_rows, key_tile, stages):
    return (block_rows + stages * key_tile) * d * 2 + ALIGN_SLACK + 8 * (1 + 3 * stages)


def _bytes_no_align(d, block_rows, key_tile, stages):
    return (block_rows + 2 * stages * key_tile) * d * 2 + 8 * (1 + 3 * stages)


def _bytes_fp32(d, block_rows, key_tile, stages):
    return (block_rows + 2 * stages * key_tile) * d * 4 + ALIGN_SLACK + 8 * (1 + 3 * stages)


def _bytes_no_barriers(d, block_rows, key_tile, stages):
    return (block_rows + 2 * stages * key_tile) * d * 2 + ALIGN_SLACK


def _bytes_no_q(d, block_rows, key_tile, stages):
    return 2 * stages * key_tile * d * 2 + ALIGN_SLACK + 8 * (1 + 3 * stages)


def _stages_first_too_many(d, block_rows, key_tile, smem_limit):
    return _fit_with(_ring_bytes)(d, block_rows, key_tile, smem_limit) + 1


STAGES_MUTANTS = [
    Mutant("only K's stages are counted: each stage holds a K tile and a V tile, 2 S key_tile d elements in all.",
           fn=_fit_with(_bytes_no_v)),
    Mutant("the 1024 bytes of alignment are missing: the dynamic shared memory is only 16-byte aligned and the "
           "kernel starts Q's tile at the next 1024-byte boundary (a 128-byte swizzle atom is 8 rows of 128 bytes), "
           "so the host reserves 1024 bytes more.", fn=_fit_with(_bytes_no_align)),
    Mutant("4 bytes an element: the tiles hold fp16 or bf16, 2 bytes an element (the fp32 accumulators live in "
           "registers).", fn=_fit_with(_bytes_fp32)),
    Mutant("the mbarriers are not counted: 8 bytes each, Q's and three per stage (K full, V full, empty), "
           "8 (1 + 3 S) bytes.", fn=_fit_with(_bytes_no_barriers)),
    Mutant("the Q tile is left out: its block_rows x d elements stay in shared memory for the whole block, beside "
           "the ring.", fn=_fit_with(_bytes_no_q)),
    Mutant("one stage too many: the answer is the largest S whose bytes fit in smem_limit, not the first that does "
           "not.", fn=_stages_first_too_many),
]

STAGES_ARGS = ("d", "block_rows", "key_tile", "smem_limit")
H100_SMEM = 227 * 1024  # what a block may opt in to on an H100 or H200
HALF_H100_SMEM = 113 * 1024  # each of two blocks on one SM (228 KB an SM, 1 KB of it reserved per block)


@LAB.question("q3", points=2, objects=("stages_that_fit",))
def q3(t: Trial, stages_that_fit) -> None:
    """stages_that_fit(d, block_rows, key_tile, smem_limit) -> the most stages that fit."""
    ref = lambda c: _stages_that_fit(*c.args)  # noqa: E731
    cases = [Case((128, 128, 128, H100_SMEM), "rung H4's tiles at d = 128 on an H100/H200 (227 KB)",
                  names=STAGES_ARGS),
             Case((64, 128, 128, H100_SMEM), "rung H4's tiles at d = 64 on an H100/H200", names=STAGES_ARGS),
             Case((128, 128, 64, HALF_H100_SMEM), "64-key tiles at d = 128 in 113 KB (two blocks an SM)",
                  names=STAGES_ARGS)]
    for _ in range(4):
        d, rows = int(t.rng.choice([64, 128, 256])), int(t.rng.choice([64, 128, 192]))
        keys = int(t.rng.choice([64, 96, 128, 176]))
        limit = int(t.rng.integers(48 * 1024, 256 * 1024))
        if _ring_bytes(d, rows, keys, _stages_that_fit(d, rows, keys, limit) + 1) - limit <= ALIGN_SLACK:
            limit -= ALIGN_SLACK  # out of the alignment's edge, which the next part tests on every seed
        cases.append(Case((d, rows, keys, limit), f"d = {d}, {rows} rows, {keys}-key tiles, {limit} bytes",
                          names=STAGES_ARGS))
    t.compare("the course's tiles and GPUs, and random ones", 1, student=stages_that_fit, cases=cases, reference=ref,
              mutants=STAGES_MUTANTS, names=("stages",), rtol=0, atol=0.5)
    d, rows, keys = int(t.rng.choice([64, 128])), int(t.rng.choice([64, 128])), int(t.rng.choice([64, 128]))
    S = int(t.rng.integers(2, 6))
    exact = _ring_bytes(d, rows, keys, S)
    barriers = BARRIER_BYTES * (1 + 3 * S)
    edge = [Case((d, rows, keys, exact), f"exactly the bytes of {S} stages", names=STAGES_ARGS),
            Case((d, rows, keys, exact - int(t.rng.integers(1, barriers + 1))),
                 f"a few bytes short of {S} stages: less than their mbarriers", names=STAGES_ARGS),
            Case((d, rows, keys, exact - ALIGN_SLACK + int(t.rng.integers(0, ALIGN_SLACK - barriers))),
                 f"short of {S} stages by less than the 1024 bytes of alignment", names=STAGES_ARGS),
            Case((d, rows, keys, _ring_bytes(d, rows, keys, 1) - 1), "one byte short of a single stage",
                 names=STAGES_ARGS)]
    t.compare("at the edge of the budget", 1, student=stages_that_fit, cases=edge, reference=ref,
              mutants=STAGES_MUTANTS, names=("stages",), rtol=0, atol=0.5)


# ------------------------------------------------------------------------------ chapter 9: the known mistakes
def _schedule_demo() -> Demo:
    return Demo(examples=[("chapter 11's ring: 8 tiles, 3 stages", (8, 3)),
                          ("rung H2's double buffer: 5 tiles, 2 stages", (5, 2))],
                right=lambda args: _schedule_rows(_schedule(*args)), names=SCHEDULE_NAMES,
                run=lambda fn, args: _schedule_rows(fn(*args)))


def _pingpong_demo() -> Demo:
    return Demo(examples=[("consumer 0, 3 tiles, its causal rows end after tile 0", (0, 3, 1)),
                          ("consumer 1, a block of 2 tiles", (1, 2, 2))],
                right=lambda args: _ops_rows(pipeline.pingpong_ops(*args)), names=PINGPONG_NAMES,
                run=lambda fn, args: _ops_rows(fn(*args)))


def _stages_demo() -> Demo:
    three = _ring_bytes(128, 128, 128, 3)
    return Demo(examples=[("rung H4's tiles at d = 128, an H100's 227 KB", (128, 128, 128, H100_SMEM)),
                          (f"4 bytes short of 3 stages ({three - 4} bytes)", (128, 128, 128, three - 4)),
                          (f"600 bytes short of 3 stages ({three - 600} bytes)", (128, 128, 128, three - 600))],
                right=lambda args: _stages_that_fit(*args), names=("stages",))


KNOWN_MISTAKES = KnownMistakes(
    demos={"SCHEDULE_MUTANTS": _schedule_demo, "PINGPONG_MUTANTS": _pingpong_demo, "STAGES_MUTANTS": _stages_demo},
)
