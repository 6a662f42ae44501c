"""Plotting helpers shared by the chapters: the online-softmax state as blocks arrive, tiles sweeping over S,
memory against sequence length.

Every helper draws into axes it is given (or makes a small figure), labels its axes with units and returns the
figure, so a chapter cell is one call. The tile pictures are drawn from :func:`tile_order`, which follows the
same loops (and the same causal skipping) as :func:`flashlab.tiled.forward`; a test checks that it does.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from . import online
from ._checks import causal_offset, check_block
from .tiled import LOOP_ORDERS

# Colours chosen to stay distinguishable in grey-scale print and for common colour-vision deficiencies.
DONE, CURRENT, SKIPPED, TODO = "#9ecae1", "#d95f02", "#bdbdbd", "white"


def trace_states(score_blocks: Sequence, value_blocks: Sequence) -> list[online.State]:
    """Fold blocks of scores and values one by one with :func:`flashlab.online.update`.

    Returns the states after 0, 1, ..., len(score_blocks) blocks (the first is the empty state). Values may be
    scalars per key (blocks of shape (k,)) or vectors (blocks of shape (k, dv)).
    """
    if len(score_blocks) != len(value_blocks):
        raise ValueError(
            f"need one block of values per block of scores; got {len(score_blocks)} and {len(value_blocks)}"
        )
    if not score_blocks:
        raise ValueError("need at least one block of scores")
    first = np.asarray(value_blocks[0])
    dv = None if first.ndim == 1 else first.shape[-1]
    states = [online.init((), dv)]
    for s, v in zip(score_blocks, value_blocks, strict=True):
        states.append(online.update(states[-1], np.asarray(s, dtype=np.float64), np.asarray(v, dtype=np.float64)))
    return states


def plot_state_trace(states: Sequence[online.State], *, exact: float | None = None, axes=None):
    """Step plots of m, l, u and the result u / l against the number of blocks seen (scalar values only).

    Blocks that raise the running max are marked with a dotted vertical line: there, l and u were rescaled by
    e^(m - m'). ``exact`` (the softmax average of the whole stream) is drawn as a horizontal line on the result.
    """
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    if np.ndim(states[0].u) != 0:
        raise ValueError("plot_state_trace draws scalar states; for vector values plot one component at a time")
    steps = np.arange(len(states))
    m = np.array([float(s.m) for s in states])
    l = np.array([float(s.l) for s in states])
    u = np.array([float(s.u) for s in states])
    with np.errstate(invalid="ignore", divide="ignore"):
        r = np.where(l > 0, u / np.where(l > 0, l, 1), np.nan)
    raised = [k for k in range(1, len(states)) if m[k] > m[k - 1] and np.isfinite(m[k - 1])]

    if axes is None:
        fig, axes = plt.subplots(1, 4, figsize=(13, 3), constrained_layout=True)
    if len(axes) != 4:
        raise ValueError(f"need 4 axes (m, l, u, result); got {len(axes)}")
    fig = axes[0].figure
    panels = [
        (m, "running max m", "score"),
        (l, "l = Σ exp(s − m)", "mass / e^m"),
        (u, "u = Σ exp(s − m)·v", "weighted sum / e^m"),
        (r, "result u / l", "value"),
    ]
    for ax, (y, title, ylabel) in zip(axes, panels, strict=True):
        ax.step(steps, y, where="post", marker="o", ms=3, label=title)
        for k in raised:
            ax.axvline(k, color=CURRENT, ls=":", lw=1)
        ax.set_title(title)
        ax.set_xlabel("blocks seen")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    if exact is not None:
        axes[3].axhline(exact, color="k", ls="--", lw=1, label="exact softmax average")
    axes[3].plot([], [], color=CURRENT, ls=":", label="max raised: rescale")
    axes[3].legend(fontsize=8, loc="best")
    return fig


def tile_order(
    n: int, m: int, block_q: int, block_k: int, loop_order: str = "kv_outer", *, causal: bool = False
) -> list[tuple[int, int]]:
    """The (query-tile, key-tile) indices in the order :func:`flashlab.tiled.forward` computes them.

    With ``causal``, tiles whose keys all lie after every query's last visible key are left out, exactly as the
    tiled forward skips them (kv_outer skips such a tile; q_outer stops the row of tiles there).
    """
    block_q, block_k = check_block(block_q, "block_q"), check_block(block_k, "block_k")
    for name, size in (("n", n), ("m", m)):
        if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 1:
            raise ValueError(f"{name} must be a positive integer; got {size!r}")
    if loop_order not in LOOP_ORDERS:
        raise ValueError(f"loop_order must be one of {LOOP_ORDERS}; got {loop_order!r}")
    offset = causal_offset(n, m)
    n_q, n_k = -(-n // block_q), -(-m // block_k)

    def masked(i: int, j: int) -> bool:
        q1 = min((i + 1) * block_q, n)
        return causal and j * block_k > (q1 - 1) + offset

    if loop_order == "kv_outer":
        return [(i, j) for j in range(n_k) for i in range(n_q) if not masked(i, j)]
    order = []
    for i in range(n_q):
        for j in range(n_k):
            if masked(i, j):
                break
            order.append((i, j))
    return order


def _draw_tiles(ax, n, m, block_q, block_k, visited, current, skipped, numbers):
    from matplotlib.patches import Rectangle

    n_q, n_k = -(-n // block_q), -(-m // block_k)
    for i in range(n_q):
        for j in range(n_k):
            x0, y0 = j * block_k, i * block_q
            w, h = min(block_k, m - x0), min(block_q, n - y0)
            if (i, j) == current:
                face = CURRENT
            elif (i, j) in visited:
                face = DONE
            elif (i, j) in skipped:
                face = SKIPPED
            else:
                face = TODO
            ax.add_patch(Rectangle((x0, y0), w, h, facecolor=face, edgecolor="k", lw=0.6,
                                   hatch="//" if (i, j) in skipped else None))
            if (i, j) in numbers:
                ax.text(x0 + w / 2, y0 + h / 2, str(numbers[(i, j)]), ha="center", va="center", fontsize=7)
    ax.set_xlim(0, m)
    ax.set_ylim(n, 0)  # row 0 of S at the top, as the matrix is written
    ax.set_aspect("equal")
    ax.set_xlabel("key index j")
    ax.set_ylabel("query index i")


def plot_tile_sweep(
    n: int,
    m: int,
    block_q: int,
    block_k: int,
    *,
    loop_orders: Sequence[str] = LOOP_ORDERS,
    causal: bool = False,
    snapshots: int = 4,
):
    """A grid of small panels: one row per loop order, the score matrix S at a few moments of the sweep.

    Tiles already computed are light, the tile being computed is dark, tiles never computed (causal skipping)
    are hatched grey; the last panel of each row numbers every tile by its visiting order.
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    if snapshots < 1:
        raise ValueError(f"snapshots must be >= 1; got {snapshots}")
    rows = len(loop_orders)
    fig, axes = plt.subplots(rows, snapshots + 1, figsize=(2.3 * (snapshots + 1), 2.5 * rows + 0.6),
                             squeeze=False, constrained_layout=True)
    n_q, n_k = -(-n // block_q), -(-m // block_k)
    everything = {(i, j) for i in range(n_q) for j in range(n_k)}
    for row, loop_order in enumerate(loop_orders):
        order = tile_order(n, m, block_q, block_k, loop_order, causal=causal)
        skipped = everything - set(order)
        at = np.unique(np.linspace(0, len(order) - 1, snapshots).round().astype(int))
        for col in range(snapshots):
            ax = axes[row, col]
            if col >= len(at):
                ax.axis("off")
                continue
            t = int(at[col])
            _draw_tiles(ax, n, m, block_q, block_k, set(order[:t]), order[t], skipped, {})
            ax.set_title(f"{loop_order}: tile {t + 1}/{len(order)}", fontsize=9)
        numbers = {tile: k + 1 for k, tile in enumerate(order)}
        _draw_tiles(axes[row, -1], n, m, block_q, block_k, set(order), None, skipped, numbers)
        axes[row, -1].set_title(f"{loop_order}: visiting order", fontsize=9)
    handles = [Patch(facecolor=DONE, edgecolor="k", label="computed earlier"),
               Patch(facecolor=CURRENT, edgecolor="k", label="being computed")]
    if causal:
        handles.append(Patch(facecolor=SKIPPED, edgecolor="k", hatch="//", label="skipped (masked)"))
    fig.legend(handles=handles, loc="outside lower center", ncol=len(handles), fontsize=8)
    fig.suptitle(f"Tiles of S (n = {n}, m = {m}, block_q = {block_q}, block_k = {block_k}"
                 f"{', causal' if causal else ''})", fontsize=10)
    return fig


def plot_memory_vs_n(ns: Sequence[int], peaks: dict[str, Sequence[float]], *, s_bytes: Sequence[float] | None = None,
                     ax=None):
    """Log-log plot of measured peak memory (bytes, drawn in MB) against sequence length, one line per method.

    ``s_bytes``, if given, is drawn dashed: the size of one n x n score matrix, for comparison.
    """
    import matplotlib.pyplot as plt

    if ax is None:
        fig, ax = plt.subplots(figsize=(5.5, 3.8), constrained_layout=True)
    for label, ys in peaks.items():
        if len(ys) != len(ns):
            raise ValueError(f"{label!r}: need one peak per n ({len(ns)}); got {len(ys)}")
        ax.loglog(ns, np.asarray(ys, dtype=float) / 1e6, marker="o", label=label)
    if s_bytes is not None:
        ax.loglog(ns, np.asarray(s_bytes, dtype=float) / 1e6, "k--", lw=1, label="one n × n matrix (float64)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(ns), [str(v) for v in ns])
    ax.set_xlabel("sequence length n (tokens)")
    ax.set_ylabel("peak memory (MB)")
    ax.set_title("Peak memory of one forward pass (tracemalloc)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    return ax.figure


def plot_causal_masks(shapes: Sequence[tuple[int, int]], *, axes=None):
    """One panel per (n, m): the causal mask of :func:`flashlab.reference.causal_mask`, key j against query i.

    Query i sees key j when j <= i + m - n: the last query is aligned with the last key, so with n > m the first
    n - m queries see no key at all (drawn hatched). The picture is the reference's own mask, not a redrawing.
    """
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch, Rectangle

    from .reference import causal_mask

    if not shapes:
        raise ValueError("need at least one (n, m) shape")
    for shape in shapes:
        if len(shape) != 2 or any(isinstance(x, bool) or not isinstance(x, (int, np.integer)) or x < 1 for x in shape):
            raise ValueError(f"each shape must be (n, m) with positive integers; got {shape!r}")
    if axes is None:
        fig, axes = plt.subplots(1, len(shapes), figsize=(3.2 * len(shapes), 3.4), constrained_layout=True,
                                 squeeze=False)
        axes = axes[0]
    if len(axes) != len(shapes):
        raise ValueError(f"need one axes per shape ({len(shapes)}); got {len(axes)}")
    fig = axes[0].figure
    for ax, (n, m) in zip(axes, shapes, strict=True):
        mask = causal_mask(n, m)
        ax.imshow(mask, cmap=ListedColormap([TODO, DONE]), vmin=0, vmax=1, aspect="equal")
        ax.set_xticks(np.arange(-0.5, m, 1), minor=True)
        ax.set_yticks(np.arange(-0.5, n, 1), minor=True)
        ax.grid(which="minor", color="k", lw=0.5)
        ax.tick_params(which="minor", length=0)
        ax.set_xticks(range(m))
        ax.set_yticks(range(n))
        for i in np.flatnonzero(~mask.any(axis=1)):
            ax.add_patch(Rectangle((-0.5, i - 0.5), m, 1, facecolor=SKIPPED, edgecolor="k", lw=0.5, hatch="//"))
        ax.plot([m - 1], [n - 1], marker="o", color=CURRENT, ms=6)
        relation = "<" if n < m else ("=" if n == m else ">")
        rule = "j ≤ i" + (f" + {m - n}" if m > n else f" − {n - m}" if n > m else "")
        ax.set_title(f"n = {n} {relation} m = {m}: {rule}", fontsize=9)
        ax.set_xlabel("key index j")
        ax.set_ylabel("query index i")
    handles = [Patch(facecolor=DONE, edgecolor="k", label="query i sees key j"),
               Patch(facecolor=TODO, edgecolor="k", label="masked"),
               Patch(facecolor=SKIPPED, edgecolor="k", hatch="//", label="row sees no key"),
               plt.Line2D([], [], marker="o", color=CURRENT, ls="", label="last query, last key")]
    fig.legend(handles=handles, loc="outside lower center", ncol=len(handles), fontsize=8)
    fig.suptitle("Causal mask: the last query is aligned with the last key", fontsize=10)
    return fig


def plot_block_masks(patterns: dict, n: int, m: int, block_q: int, block_k: int, *, axes=None):
    """One panel per pattern: its element mask over S, and its tiles coloured by kind.

    ``patterns`` maps a title to a :mod:`flashlab.blocksparse` pattern (or an (n, m) boolean mask). Visible pairs
    are drawn dark; EMPTY tiles are hatched grey (never loaded), FULL tiles light (computed with no mask), PARTIAL
    tiles keep the element mask on view inside an orange frame (masked element by element). The tiles come from
    the pattern's own :meth:`~flashlab.blocksparse.Pattern.block_mask`, the one the tiled forward uses.
    """
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch, Rectangle

    from . import blocksparse

    if not patterns:
        raise ValueError("need at least one pattern")
    if axes is None:
        fig, axes = plt.subplots(1, len(patterns), figsize=(3.4 * len(patterns), 4.2), constrained_layout=True,
                                 squeeze=False)
        axes = axes[0]
    if len(axes) != len(patterns):
        raise ValueError(f"need one axes per pattern ({len(patterns)}); got {len(axes)}")
    fig = axes[0].figure
    visible = "#08519c"
    for ax, (title, pattern) in zip(axes, patterns.items(), strict=True):
        pattern = blocksparse.as_pattern(pattern)
        tiles = pattern.block_mask(n, m, block_q, block_k)
        ax.imshow(pattern.mask(n, m), cmap=ListedColormap([TODO, visible]), vmin=0, vmax=1,
                  extent=(0, m, n, 0), interpolation="nearest")
        for i in range(tiles.shape[0]):
            for j in range(tiles.shape[1]):
                q0, q1, k0, k1 = tiles.bounds(i, j)
                kind = tiles.kinds[i, j]
                if kind == blocksparse.EMPTY:
                    patch = Rectangle((k0, q0), k1 - k0, q1 - q0, facecolor=SKIPPED, edgecolor="k", lw=0.4, hatch="//")
                elif kind == blocksparse.FULL:
                    patch = Rectangle((k0, q0), k1 - k0, q1 - q0, facecolor=DONE, edgecolor="k", lw=0.4)
                else:
                    patch = Rectangle((k0, q0), k1 - k0, q1 - q0, fill=False, edgecolor=CURRENT, lw=1.4)
                ax.add_patch(patch)
        counts = tiles.counts()
        ax.set_title(f"{title}\n{counts['full']} full, {counts['partial']} partial, {counts['empty']} empty",
                     fontsize=9)
        ax.set_xlim(0, m)
        ax.set_ylim(n, 0)  # row 0 of S at the top, as the matrix is written
        ax.set_xlabel("key index j")
        ax.set_ylabel("query index i")
    handles = [Patch(facecolor=SKIPPED, edgecolor="k", hatch="//", label="EMPTY: skipped"),
               Patch(facecolor=DONE, edgecolor="k", label="FULL: no mask"),
               Patch(facecolor=TODO, edgecolor=CURRENT, lw=1.4, label="PARTIAL: masked per element"),
               Patch(facecolor=visible, label="query i sees key j")]
    fig.legend(handles=handles, loc="outside lower center", ncol=len(handles), fontsize=8)
    fig.suptitle(f"Tiles of S (n = {n}, m = {m}, block_q = {block_q}, block_k = {block_k})", fontsize=10)
    return fig


def plot_ring_work(works: dict[str, Sequence[float]], *, ylabel: str = "(query, key) pairs scored", ax=None):
    """Grouped bars: the work of each device of a ring under each layout (``{layout: work per device}``, e.g.
    ``flashlab.ring.work(...)["pairs"]``), with each layout's mean as a dotted line: the gap between the tallest
    bar and the line is time the other devices wait."""
    import matplotlib.pyplot as plt

    if not works:
        raise ValueError("need the work of at least one layout")
    sizes = {len(w) for w in works.values()}
    if len(sizes) != 1:
        raise ValueError(f"every layout needs one value per device; got lengths {sorted(sizes)}")
    world = sizes.pop()
    if ax is None:
        _, ax = plt.subplots(figsize=(6, 3.2), constrained_layout=True)
    width = 0.8 / len(works)
    x = np.arange(world)
    for i, (name, w) in enumerate(works.items()):
        w = np.asarray(w, dtype=float)
        label = f"{name} (max / mean = {w.max() / w.mean():.2f})"
        ax.bar(x + (i - (len(works) - 1) / 2) * width, w, width, label=label, color=f"C{i}")
        ax.axhline(w.mean(), color=f"C{i}", ls=":", lw=1)
    ax.set_xticks(x)
    ax.set_xlabel("device p")
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=8)
    return ax.figure


# The implementations of `python -m flashlab bench sparse`, with their dense causal row: (label, colour, dense impl).
SPARSE_IMPLS = {"hopper_window": ("Hopper window kernel (window=)", "#1f78b4", "causal"),
                "hopper_blocks": ("Hopper list kernel (block_mask=)", "#e7298a", "causal"),
                "sparse_window": ("sm_80 window kernel (window=)", "#1b9e77", "causal"),
                "sparse_blocks": ("sm_80 list kernel (block_mask=)", "#7570b3", "causal"),
                "flex": ("FlexAttention, same mask", "#d95f02", "flex_causal")}


def plot_sparse_times(record: dict, *, axes=None):
    """Time against the density of computed tiles, one panel per timing protocol, from a record of ``python -m
    flashlab bench sparse`` (``records.read_record("benchmarks/sparse")``).

    Each implementation the record timed (``SPARSE_IMPLS``: FlexAttention too once the record has it) is a line over
    the sliding windows per sequence length (marker per n) and an open marker for the dilated pattern; a star is
    dense causal attention (the course's kernel in black, FlexAttention's in its colour), and the dashed line through
    the black star is time proportional to the computed tiles. The caption names the GPU, the date and the command
    of the record, and the implementations it holds only errors for. Log-log axes; x is the fraction of the
    window kernel's 128 x 64 tiles computed (the same x for every implementation of a pattern, but for a row that ran
    a dilation as residue classes: its ``computed_density``, the tiles it computed).
    """
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    from .records import PROTOCOLS, protocol_of

    rows = [r for r in record["rows"] if "error" not in r]
    protocols = [p for p in PROTOCOLS if any(protocol_of(r) == p for r in rows)]
    if not protocols:
        raise ValueError("the record holds no timed row")
    if axes is None:
        _, axes = plt.subplots(1, len(protocols), figsize=(5.2 * len(protocols), 4.6), constrained_layout=True,
                               squeeze=False, sharey=True)
        axes = axes[0]
    if len(axes) != len(protocols):
        raise ValueError(f"need one axes per protocol ({len(protocols)}); got {len(axes)}")
    fig = axes[0].figure
    ns = sorted({r["n"] for r in rows})
    markers = dict(zip(ns, "osD^v", strict=False))
    impls = [i for i in SPARSE_IMPLS if any(r["impl"] == i for r in rows)]
    for ax, protocol in zip(axes, protocols, strict=True):
        mine = [r for r in rows if protocol_of(r) == protocol]
        for n in ns:
            dense = {r["impl"]: r for r in mine if r["n"] == n and r["impl"] in ("causal", "flex_causal")}
            for impl in impls:
                label, colour, dense_impl = SPARSE_IMPLS[impl]
                pts = [r for r in mine if r["n"] == n and r["impl"] == impl]
                windows = sorted((r for r in pts if r["dilation"] == 1), key=lambda r: r["density"])
                ax.plot([r["density"] for r in windows], [r["median_ms"] for r in windows], color=colour,
                        marker=markers[n], ms=5, lw=1.2)
                ax.plot([r.get("computed_density", r["density"]) for r in pts if r["dilation"] > 1],
                        [r["median_ms"] for r in pts if r["dilation"] > 1], color=colour, marker=markers[n], ms=9,
                        mfc="none", ls="none")
                if dense_impl == "flex_causal" and "flex_causal" in dense:
                    ax.plot(dense["flex_causal"]["density"], dense["flex_causal"]["median_ms"], marker="*", ms=13,
                            color=colour, ls="none")
            if "causal" in dense:
                c = dense["causal"]
                lo = min((r.get("computed_density", r["density"]) for r in mine if r["n"] == n), default=c["density"])
                x = np.array([lo, c["density"]])
                ax.plot(x, c["median_ms"] * x / c["density"], color="0.4", ls="--", lw=1)
                ax.plot(c["density"], c["median_ms"], marker="*", ms=13, color="k", ls="none")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("computed tiles / all tiles (density)")
        ax.set_title(f"{protocol} protocol", fontsize=10)
        ax.grid(True, which="both", alpha=0.25)
    axes[0].set_ylabel("time per call (ms)")
    handles = [Line2D([], [], color=SPARSE_IMPLS[i][1], lw=1.2, label=SPARSE_IMPLS[i][0]) for i in impls]
    handles += [Line2D([], [], color="0.3", marker=markers[n], ls="none", label=f"n = {n:,}") for n in ns]
    handles += [Line2D([], [], color="0.3", marker="o", mfc="none", ms=9, ls="none", label="dilated pattern"),
                Line2D([], [], color="k", marker="*", ms=12, ls="none", label="dense causal (course kernel)"),
                Line2D([], [], color="0.4", ls="--", label="proportional to computed tiles")]
    fig.legend(handles=handles, loc="outside right center", fontsize=8)
    prov = record["provenance"]
    shape = rows[0]
    caption = (f"Recorded on {prov['gpu']}, {prov['date_utc'][:10]} (UTC): {prov['command']}\n"
               f"{shape['dtype']}, d = {shape['d']}, {shape['heads']} heads, batch {shape['batch']}, self-attention")
    missing = sorted({r["impl"] for r in record["rows"] if "error" in r} - {r["impl"] for r in rows})
    if missing:
        caption += f"; not timed in this record: {', '.join(missing)}"
    fig.text(0.01, 0.0, caption, fontsize=7.5, va="top", ha="left", transform=fig.transFigure)
    return fig


def fragment_labels(where, shape: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """For each element of a ``shape`` operand, the lane that holds it under the map ``where`` (a function lane ->
    [(row, column), ...] in register order, like :func:`flashlab.fragments.c_positions`) and its value index in
    that lane; -1 where no lane holds it, -2 where several do. Positions outside the operand are ignored."""
    lanes = np.full(shape, -1)
    values = np.full(shape, -1)
    for lane in range(32):
        for value, (r, c) in enumerate(where(lane)):
            if 0 <= r < shape[0] and 0 <= c < shape[1]:
                lanes[r, c], values[r, c] = (lane, value) if lanes[r, c] == -1 else (-2, -2)
    return lanes, values


def plot_fragment_layouts(layouts: dict, *, axes=None):
    """One panel per operand of a warp-wide ``mma.sync``: every element labelled ``lane:value`` (the lane that holds
    it and the place in that lane's registers), coloured by the lane's group g = lane // 4, so that the four lanes of
    a quad share a colour. ``layouts`` is ``{title: (map, (rows, columns))}``, e.g. ``{"A (16 × 16)":
    (fragments.a_positions, (16, 16)), ...}``. Grey with ``?``: no lane holds the element; black with ``!!``:
    several do."""
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap

    if not layouts:
        raise ValueError("need at least one operand to draw")
    if axes is None:
        widths = [shape[1] for _, shape in layouts.values()]
        height = max(shape[0] for _, shape in layouts.values())
        _, axes = plt.subplots(1, len(layouts), figsize=(0.42 * sum(widths) + 1.2, 0.36 * height + 1.2),
                               gridspec_kw={"width_ratios": widths}, constrained_layout=True)
    axes = np.atleast_1d(axes)
    # Eight groups (quads): colours that stay apart in grey-scale print too, then grey (no lane) and black (several).
    groups = ["#a6cee3", "#1f78b4", "#b2df8a", "#33a02c", "#fb9a99", "#e31a1c", "#fdbf6f", "#ff7f00"]
    cmap = ListedColormap(groups + ["#d9d9d9", "#000000"])
    for ax, (title, (where, shape)) in zip(axes, layouts.items(), strict=False):
        lanes, values = fragment_labels(where, shape)
        colour = np.where(lanes >= 0, lanes // 4, np.where(lanes == -1, 8, 9))
        ax.imshow(colour, cmap=cmap, vmin=-0.5, vmax=9.5, aspect="equal")
        for (r, c), lane in np.ndenumerate(lanes):
            text = f"{lane}:{values[r, c]}" if lane >= 0 else ("?" if lane == -1 else "!!")
            ax.text(c, r, text, ha="center", va="center", fontsize=6,
                    color="white" if lane == -2 or (lane >= 0 and lane // 4 in (1, 3, 5)) else "black")
        ax.set_xticks(range(shape[1]))
        ax.set_yticks(range(shape[0]))
        ax.tick_params(labelsize=7)
        ax.set_xlabel("column", fontsize=8)
        ax.set_ylabel("row", fontsize=8)
        ax.set_title(title, fontsize=9)
    return axes[0].figure
