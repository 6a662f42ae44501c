"""Lab 10 — ring attention: one device's step, its whole ring, and the causal work per device.

q1 ``ring_step(m, l, u, q, k, v, q_pos, k_pos, causal, offset) -> (m, l, u)``: fold one K/V block that arrived
from another device into the online-softmax state of this device's queries; the causal mask uses the global
positions of the rows (query i sees key j when j <= i + offset, offset = m - n of the whole attention). Checked on
states made from real earlier blocks, remote and own blocks of contiguous and zig-zag layouts, n != m, scores up
to 1000 in size, and rows that see no key.

q2 ``ring_device(rank, world, q, k_arrivals, v_arrivals, q_positions, k_positions, causal, offset) -> (O, L)``:
everything device ``rank`` does: fold the blocks in the order they arrive (step 0 its own, step s the block of
device (rank - s) mod world), each masked with the positions of the device it came from, then the final merge
O = u / l, L = m + log l (rows that saw no key: O = 0, L = -inf). Its inputs split n and m into equal blocks
(the grader's feedback shows lists of equal arrays; q1 covers ragged blocks).

q3 ``causal_work(n, world, layout) -> (world,)``: the (query, key) pairs each device scores under a causal mask
(n = m), for the contiguous and the zig-zag layouts.

Everything is graded on the CPU.
"""

from __future__ import annotations

import numpy as np

from .. import online, reference, ring
from .core import Case, Lab, Mutant, Trial

LAB = Lab("lab10", "Ring attention: one device's step and the whole ring")

# The course's own answers to each question (flashlab.grading.answers): calling one scores 0. q1's answer is the
# ring's step and chapter 1's update inside it; q2's, the device loop, the ring and any whole attention; q3's, the
# work count and the layout itself.
# The grader's own correct pieces of a step (scores with the causal mask, the fold, the final division) answer q1
# and q2 as much as ring.step does.
_HELPERS = tuple(f"flashlab.grading.lab10.{name}" for name in ("_scores", "_fold_scores", "_finish"))
ANSWERS = {
    "q1": ("flashlab.ring.step", "flashlab.online.update", "flashlab.grading.lab10._step", *_HELPERS),
    "q2": ("flashlab.ring.run_device", "flashlab.ring.attention", "flashlab.reference.attention",
           "flashlab.tiled.forward", "flashlab.grading.lab10._device", *_HELPERS),
    "q3": ("flashlab.ring.work", "flashlab.ring.split", "flashlab.grading.lab10._work"),
}

STEP_ARGS = ("m", "l", "u", "q", "k", "v", "q_pos", "k_pos", "causal", "offset")
DEVICE_ARGS = ("rank", "world", "q", "k_arrivals", "v_arrivals", "q_positions", "k_positions", "causal", "offset")


# ------------------------------------------------------------------------------------------- truth and helpers
def _step(m, l, u, q, k, v, q_pos, k_pos, causal, offset):
    s = ring.step(online.State(np.asarray(m, float), np.asarray(l, float), np.asarray(u, float)), q, k, v,
                  np.asarray(q_pos), np.asarray(k_pos), causal=bool(causal), offset=int(offset))
    return s.m, s.l, s.u


def _finish(m, l, u):
    return online.State(np.asarray(m, float), np.asarray(l, float), np.asarray(u, float)).result(), \
        online.State(np.asarray(m, float), np.asarray(l, float), np.asarray(u, float)).logsumexp()


def _device(rank, world, q, k_arrivals, v_arrivals, q_positions, k_positions, causal, offset, *, step=_step):
    m, l, u = np.full(q.shape[0], -np.inf), np.zeros(q.shape[0]), np.zeros((q.shape[0], v_arrivals[0].shape[1]))
    for s in range(world):
        src = (rank - s) % world
        m, l, u = step(m, l, u, q, k_arrivals[s], v_arrivals[s], q_positions[rank], k_positions[src], causal, offset)
    return _finish(m, l, u)


def _work(n, world, layout):
    return ring.work(n, world, layout=layout)["pairs"]


def _layout(t: Trial, n: int, world: int, layout: str) -> list[np.ndarray]:
    return ring.split(n, world, layout)


def _scores(q, k, q_pos, k_pos, causal, offset, *, strict=False, local=False, flip=False, scale=True):
    d = q.shape[1]
    s = (q @ k.T) / (np.sqrt(d) if scale else 1.0)
    if causal:
        qp = np.arange(q.shape[0]) if local else np.asarray(q_pos)
        kp = np.arange(k.shape[0]) if local else np.asarray(k_pos)
        if flip:
            seen = kp[None, :] >= qp[:, None] + offset
        elif strict:
            seen = kp[None, :] < qp[:, None] + offset
        else:
            seen = kp[None, :] <= qp[:, None] + offset
        s = np.where(seen, s, -np.inf)
    return s


def _fold_scores(m, l, u, s, v, *, rescale_l=True, rescale_u=True, ignore_old_max=False, guard=True):
    with np.errstate(all="ignore"):
        m = np.asarray(m, float)
        m_new = s.max(axis=1) if ignore_old_max else np.maximum(m, s.max(axis=1))
        ref = np.where(np.isfinite(m_new), m_new, 0.0) if guard else m_new
        alpha = np.exp(m - ref)
        p = np.exp(s - ref[:, None])
        l_new = (alpha * l if rescale_l else np.asarray(l, float)) + p.sum(axis=1)
        u_new = (alpha[:, None] * u if rescale_u else np.asarray(u, float)) + p @ v
        if ignore_old_max:
            m_new = np.where(np.isfinite(m_new), m_new, m)
        return m_new, l_new, u_new


# --------------------------------------------------------------------------------------------- q1 mutants
def _step_no_rescale(m, l, u, q, k, v, q_pos, k_pos, causal, offset):
    return _fold_scores(m, l, u, _scores(q, k, q_pos, k_pos, causal, offset), v, rescale_l=False, rescale_u=False)


def _step_rescales_l_only(m, l, u, q, k, v, q_pos, k_pos, causal, offset):
    return _fold_scores(m, l, u, _scores(q, k, q_pos, k_pos, causal, offset), v, rescale_u=False)


def _step_local_positions(m, l, u, q, k, v, q_pos, k_pos, causal, offset):
    return _fold_scores(m, l, u, _scores(q, k, q_pos, k_pos, causal, offset, local=True), v)


def _step_no_offset(m, l, u, q, k, v, q_pos, k_pos, causal, offset):
    return _fold_scores(m, l, u, _scores(q, k, q_pos, k_pos, causal, 0), v)


def _step_strict(m, l, u, q, k, v, q_pos, k_pos, causal, offset):
    return _fold_scores(m, l, u, _scores(q, k, q_pos, k_pos, causal, offset, strict=True), v)


def _step_flipped(m, l, u, q, k, v, q_pos, k_pos, causal, offset):
    return _fold_scores(m, l, u, _scores(q, k, q_pos, k_pos, causal, offset, flip=True), v)


def _step_no_scale(m, l, u, q, k, v, q_pos, k_pos, causal, offset):
    return _fold_scores(m, l, u, _scores(q, k, q_pos, k_pos, causal, offset, scale=False), v)


def _step_unguarded(m, l, u, q, k, v, q_pos, k_pos, causal, offset):
    return _fold_scores(m, l, u, _scores(q, k, q_pos, k_pos, causal, offset), v, guard=False)


def _step_new_max_only(m, l, u, q, k, v, q_pos, k_pos, causal, offset):
    return _fold_scores(m, l, u, _scores(q, k, q_pos, k_pos, causal, offset), v, ignore_old_max=True)


STEP_MUTANTS = [
    Mutant("forgetting to rescale across devices: when a block raises the running max from m to m', what the state "
           "holds was measured against m and must be multiplied by e^(m - m') (both l and u).", fn=_step_no_rescale),
    Mutant("u is not rescaled: when the max rises, multiply u by e^(m - m') as well as l.",
           fn=_step_rescales_l_only),
    Mutant("the causal mask uses the block's local row numbers: a remote block must be masked with the global "
           "positions q_pos and k_pos of its rows (query i sees key j when j <= i + offset).",
           fn=_step_local_positions),
    Mutant("the causal offset is missing: query i sees key j when j <= i + offset, offset = m - n of the whole "
           "attention (0 only when n = m).", fn=_step_no_offset),
    Mutant("the diagonal is masked: query i sees key j when j <= i + offset, the key at its own position included "
           "(<=, not <).", fn=_step_strict),
    Mutant("the mask is the wrong way round: a query sees the keys before it (j <= i + offset), not those after.",
           fn=_step_flipped),
    Mutant("the scale 1/sqrt(d) is missing: the scores are q k^T / sqrt(d).", fn=_step_no_scale),
    Mutant("a row that has seen no key and sees none in this block gives nan: with m' = -inf, e^(m - m') is "
           "e^(-inf + inf); measure against 0 when m' = -inf, so the state stays (-inf, 0, 0).", fn=_step_unguarded),
    Mutant("the new max ignores the old one: m' = max(m, max of the block's scores); with the block's max alone "
           "e^(m - m') overflows when the state's max is far larger.", fn=_step_new_max_only),
]


def _step_case(t: Trial, *, n: int, m_keys: int, world: int, layout: str, causal: bool, magnitude: float,
               label: str, remote: bool = True, d: int | None = None, dv: int | None = None) -> Case:
    """The state of device ``rank`` after its own block, and the block of another device to fold next."""
    d = d or int(t.rng.integers(2, 7))
    dv = dv or int(t.rng.integers(1, 4))
    qs, ks = ring.split(n, world, layout), ring.split(m_keys, world, layout)
    rank = int(t.rng.integers(0, world))
    src = (rank - int(t.rng.integers(1, world))) % world if remote and world > 1 else rank
    offset = m_keys - n
    Q, K, V = t.rng.standard_normal((n, d)), t.rng.standard_normal((m_keys, d)), t.rng.standard_normal((m_keys, dv))
    Q *= magnitude
    q_pos = qs[rank]
    first = ks[rank] if src != rank else ks[(rank + 1) % world]
    m0, l0, u0 = np.full(q_pos.size, -np.inf), np.zeros(q_pos.size), np.zeros((q_pos.size, dv))
    m0, l0, u0 = _step(m0, l0, u0, Q[q_pos], K[first] * 0.25, V[first], q_pos, first, causal, offset)
    k_pos = ks[src]
    return Case((m0, l0, u0, Q[q_pos], K[k_pos], V[k_pos], q_pos, k_pos, causal, offset),
                f"{label}: device {rank} of {world} ({layout}), n={n}, m={m_keys}, block of device {src}",
                names=STEP_ARGS)


@LAB.question("q1", points=4, objects=("ring_step",))
def q1(t: Trial, ring_step) -> None:
    """ring_step(m, l, u, q, k, v, q_pos, k_pos, causal, offset) -> (m, l, u) after folding in one block."""
    names = ("m", "l", "u")
    ref = lambda c: _step(*c.args)  # noqa: E731
    plain = [_step_case(t, n=int(t.rng.integers(6, 30)), m_keys=int(t.rng.integers(6, 30)),
                        world=int(t.rng.integers(2, 5)), layout=ring.LAYOUTS[i % 2], causal=False, magnitude=3.0,
                        label="not causal") for i in range(4)]
    t.compare("a block from another device, not causal", 1, student=ring_step, cases=plain, reference=ref,
              mutants=STEP_MUTANTS, names=names)
    causal = []
    for i in range(6):
        n = int(t.rng.integers(8, 40))
        m_keys = n if i < 3 else int(t.rng.integers(8, 40))
        causal.append(_step_case(t, n=n, m_keys=m_keys, world=int(t.rng.integers(2, 5)), layout=ring.LAYOUTS[i % 2],
                                 causal=True, magnitude=3.0, label="causal"))
    causal.append(_step_case(t, n=16, m_keys=16, world=2, layout="contiguous", causal=True, magnitude=3.0,
                             label="causal, the diagonal block", remote=False))
    t.compare("causal blocks at their global positions (n = m and n != m)", 2, student=ring_step, cases=causal,
              reference=ref, mutants=STEP_MUTANTS, names=names)
    edge = [_step_case(t, n=12, m_keys=12, world=3, layout="zigzag", causal=True, magnitude=300.0,
                       label="scores up to about 1000 in size"),
            _step_case(t, n=12, m_keys=12, world=2, layout="contiguous", causal=False, magnitude=300.0,
                       label="scores up to about 1000 in size"),
            _step_case(t, n=20, m_keys=8, world=2, layout="contiguous", causal=True, magnitude=1.0,
                       label="n > m: the first rows see no key")]
    t.compare("huge scores and rows that see no key", 1, student=ring_step, cases=edge, reference=ref,
              mutants=STEP_MUTANTS, names=names)


# ------------------------------------------------------------------------------------------------------ q2
def _device_double_own(rank, world, q, k_arrivals, v_arrivals, q_positions, k_positions, causal, offset):
    m, l, u = np.full(q.shape[0], -np.inf), np.zeros(q.shape[0]), np.zeros((q.shape[0], v_arrivals[0].shape[1]))
    m, l, u = _step(m, l, u, q, k_arrivals[0], v_arrivals[0], q_positions[rank], k_positions[rank], causal, offset)
    for s in range(world):
        src = (rank - s) % world
        m, l, u = _step(m, l, u, q, k_arrivals[s], v_arrivals[s], q_positions[rank], k_positions[src], causal,
                        offset)
    return _finish(m, l, u)


def _device_with(source, last=None, finish=_finish):
    def device(rank, world, q, k_arrivals, v_arrivals, q_positions, k_positions, causal, offset):
        m, l, u = np.full(q.shape[0], -np.inf), np.zeros(q.shape[0]), np.zeros((q.shape[0], v_arrivals[0].shape[1]))
        for s in range(world if last is None else last(world)):
            m, l, u = _step(m, l, u, q, k_arrivals[s], v_arrivals[s], q_positions[rank],
                            k_positions[source(rank, s, world)], causal, offset)
        return finish(m, l, u)
    return device


def _finish_unnormalised(m, l, u):
    return np.asarray(u, float), _finish(m, l, u)[1]


def _finish_lse_is_max(m, l, u):
    return _finish(m, l, u)[0], np.asarray(m, float)


def _finish_unguarded(m, l, u):
    with np.errstate(all="ignore"):
        return np.asarray(u, float) / np.asarray(l, float)[:, None], _finish(m, l, u)[1]


def _finish_log2(m, l, u):
    with np.errstate(divide="ignore"):
        return _finish(m, l, u)[0], np.asarray(m, float) + np.log2(np.asarray(l, float))


_device_wrong_direction = _device_with(lambda rank, s, world: (rank + s) % world)
_device_own_positions = _device_with(lambda rank, s, world: rank)
_device_skips_last = _device_with(lambda rank, s, world: (rank - s) % world, last=lambda world: world - 1)
_device_unnormalised = _device_with(lambda rank, s, world: (rank - s) % world, finish=_finish_unnormalised)
_device_lse_is_max = _device_with(lambda rank, s, world: (rank - s) % world, finish=_finish_lse_is_max)
_device_unguarded = _device_with(lambda rank, s, world: (rank - s) % world, finish=_finish_unguarded)
_device_log2 = _device_with(lambda rank, s, world: (rank - s) % world, finish=_finish_log2)


DEVICE_MUTANTS = [
    Mutant("the own block is counted twice: it is step 0 of the ring (k_arrivals[0]); fold each of the world "
           "arrivals exactly once.", fn=_device_double_own),
    Mutant("the blocks are merged in the wrong causal order: blocks travel from device p to p + 1, so the block "
           "that arrives at step s comes from device (rank - s) mod world, and must be masked with that device's "
           "k_positions, not those of (rank + s) mod world.", fn=_device_wrong_direction),
    Mutant("every block is masked with the device's own key positions: a block that arrives is masked where it "
           "lies in the sequence, k_positions[(rank - s) mod world].", fn=_device_own_positions),
    Mutant("the last block is left out: world blocks arrive (the own one and world - 1 from the ring); fold all of "
           "them.", fn=_device_skips_last),
    Mutant("the output is not normalised: the final merge is O = u / l.", fn=_device_unnormalised,
           key=lambda out: out[:1]),
    Mutant("L is the running max alone: the logsumexp is m + log(l).", fn=_device_lse_is_max,
           key=lambda out: out[1:2]),
    Mutant("a row that saw no key gives nan: where l = 0 the row's output is 0 (and its L is -inf); divide by l "
           "only where l > 0.", fn=_device_unguarded, key=lambda out: out[:1]),
    Mutant("L is in base 2: the logsumexp is m + ln(l) (np.log, not np.log2).", fn=_device_log2,
           key=lambda out: out[1:2]),
]


def _device_case(t: Trial, *, n: int, m_keys: int, world: int, layout: str, causal: bool, label: str,
                 rank: int | None = None) -> Case:
    d, dv = int(t.rng.integers(2, 6)), int(t.rng.integers(1, 4))
    qs, ks = ring.split(n, world, layout), ring.split(m_keys, world, layout)
    rank = int(t.rng.integers(0, world)) if rank is None else rank
    Q, K, V = t.rng.standard_normal((n, d)) * 2, t.rng.standard_normal((m_keys, d)), t.rng.standard_normal((m_keys, dv))
    order = [(rank - s) % world for s in range(world)]
    return Case((rank, world, Q[qs[rank]], [K[ks[p]] for p in order], [V[ks[p]] for p in order], list(qs), list(ks),
                 causal, m_keys - n),
                f"{label}: device {rank} of {world} ({layout}), n={n}, m={m_keys}", names=DEVICE_ARGS)


def _device_truth(case: Case):
    return _device(*case.args)


@LAB.question("q2", points=4, objects=("ring_device",), uses=("ring_step",))
def q2(t: Trial, ring_device) -> None:
    """ring_device(rank, world, q, k_arrivals, v_arrivals, q_positions, k_positions, causal, offset) -> (O, L)."""
    names = ("O", "L")
    cases = []
    for i in range(6):
        world = int(t.rng.integers(3, 6))
        n = 2 * world * int(t.rng.integers(1, 5))
        cases.append(_device_case(t, n=n, m_keys=n, world=world, layout=ring.LAYOUTS[i % 2], causal=True,
                                  label="causal", rank=1 + i % (world - 1)))
    t.compare("a device of a causal ring", 2, student=ring_device, cases=cases, reference=_device_truth,
              mutants=DEVICE_MUTANTS, names=names)
    other = []
    for _ in range(3):
        world = int(t.rng.integers(2, 5))
        n, m_keys = (2 * world * int(t.rng.integers(1, 5)) for _ in range(2))
        other.append(_device_case(t, n=n, m_keys=m_keys, world=world, layout="zigzag", causal=False,
                                  label="not causal"))
    other.append(_device_case(t, n=24, m_keys=9, world=3, layout="contiguous", causal=True,
                              label="n > m: device 0's rows see no key", rank=0))
    other.append(_device_case(t, n=30, m_keys=12, world=3, layout="zigzag", causal=True,
                              label="n > m, zig-zag", rank=0))
    t.compare("not causal, n != m, rows that see no key", 2, student=ring_device, cases=other,
              reference=_device_truth, mutants=DEVICE_MUTANTS, names=names)


# ------------------------------------------------------------------------------------------------------ q3
def _direct_work(n, world, chunks_of):
    mask = reference.causal_mask(n, n)
    return np.array([int(mask[rows].sum()) for rows in chunks_of(n, world)])


def _zigzag_striped(n, world):
    chunks = np.array_split(np.arange(n), 2 * world)
    return [np.concatenate([chunks[p], chunks[world + p]]) for p in range(world)]


def _floor_split(n, world, layout):
    step = max(n // world, 1)
    rows = np.arange(n)
    if layout == "contiguous":
        return [rows[p * step:(p + 1) * step] if p < world - 1 else rows[p * step:] for p in range(world)]
    step = max(n // (2 * world), 1)
    chunks = [rows[c * step:(c + 1) * step] if c < 2 * world - 1 else rows[c * step:] for c in range(2 * world)]
    return [np.concatenate([chunks[p], chunks[2 * world - 1 - p]]) for p in range(world)]


def _work_striped(n, world, layout):
    if layout == "contiguous":
        return _work(n, world, layout)
    return _direct_work(n, world, _zigzag_striped)


def _work_strict(n, world, layout):
    return _work(n, world, layout) - np.array([r.size for r in ring.split(n, world, layout)])


def _work_unmasked(n, world, layout):
    return np.array([r.size * n for r in ring.split(n, world, layout)])


def _work_upper(n, world, layout):
    return np.array([int((n - r).sum()) for r in ring.split(n, world, layout)])


def _work_floor(n, world, layout):
    mask = reference.causal_mask(n, n)
    return np.array([int(mask[rows].sum()) for rows in _floor_split(n, world, layout)])


WORK_MUTANTS = [
    Mutant("the zig-zag pairs chunk p with chunk p + world: device p holds chunk p and its mirror 2 world - 1 - p, "
           "one early and one late chunk.", fn=_work_striped),
    Mutant("the diagonal is not counted: query i sees keys j <= i, its own position included.", fn=_work_strict),
    Mutant("the mask is ignored: under a causal mask query i scores i + 1 keys, not n.", fn=_work_unmasked),
    Mutant("the wrong triangle is counted: query i sees the keys up to its own position (i + 1 of them), not "
           "those from it on.", fn=_work_upper),
    Mutant("the rows are split with n // world per device and the rest on the last: the course splits as "
           "np.array_split does (the first n mod world devices get one row more), for chunks as well.",
           fn=_work_floor),
]


@LAB.question("q3", points=2, objects=("causal_work",))
def q3(t: Trial, causal_work) -> None:
    """causal_work(n, world, layout) -> the (query, key) pairs each device scores under a causal mask."""
    cases = []
    for layout in ring.LAYOUTS:
        for _ in range(3):
            world = int(t.rng.integers(2, 7))
            n = int(t.rng.integers(4 * world, 200))
            n += (n % (2 * world) == 0)  # ragged: the split of the rows shows
            cases.append(Case((n, world, layout), f"n={n}, world={world}, {layout}"))
    cases.append(Case((64, 4, "zigzag"), "n=64, world=4, zigzag"))
    t.compare("work per device, both layouts", 2, student=causal_work, cases=cases,
              reference=lambda c: _work(*c.args), mutants=WORK_MUTANTS, names=("pairs",), rtol=0, atol=0.5)
