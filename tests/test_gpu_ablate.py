"""The ablation variants of rungs 6 and 8 (``python -m flashlab bench ablate``): each computes attention, at ragged
shapes with and without the causal mask, as closely to float64 as the rung itself; and the bench's rules."""

from __future__ import annotations

import numpy as np
import pytest

from flashlab import reference
from flashlab.bench import ablate


def test_each_rung_lists_its_changes_and_the_rung_before():
    import flashlab.gpu as fgpu

    for rung, (before, changes) in ablate.ABLATIONS.items():
        assert before in fgpu.RUNGS and rung in fgpu.RUNGS
        head = (fgpu.KERNEL_DIR / fgpu.RUNGS[rung].file).read_text().split("\n\n")[0]
        assert len(changes) == head.count("\n// * ") + head.startswith("// * ")  # one variant per listed change
        for name, _, defines, _ in changes:
            v = ablate.variant(rung, name, defines)
            assert set(defines) <= set(v.defines) and v.name == f"{rung}-{name}"
    assert ablate.acts("causal", 64, True) and not ablate.acts("causal", 64, False)
    assert ablate.acts("d128", 128, False) and not ablate.acts("d128", 64, True) and ablate.acts(None, 64, False)


@pytest.mark.gpu
@pytest.mark.parametrize("rung", sorted(ablate.ABLATIONS))
def test_every_variant_is_as_accurate_as_its_rung(rung, rng):
    import cupy as cp

    import flashlab.gpu as fgpu

    for d in fgpu.HEAD_DIMS:
        for n, m, causal in ((77, 131, True), (131, 77, True), (200, 200, False)):
            q, k, v = (rng.standard_normal(s).astype(np.float16) for s in ((1, 2, n, d), (1, 2, m, d), (1, 2, m, d)))
            want, _ = reference.attention(*(x.astype(np.float64) for x in (q, k, v)), causal=causal)
            got_rung = fgpu.attention(*map(cp.asarray, (q, k, v)), causal=causal, kernel=rung)[0].get()
            base = np.abs(got_rung.astype(np.float64) - want).max()
            for name, _, defines, _ in ablate.ABLATIONS[rung][1]:
                got = fgpu.attention(*map(cp.asarray, (q, k, v)), causal=causal,
                                     kernel=ablate.variant(rung, name, defines))[0].get()
                err = np.abs(got.astype(np.float64) - want).max()
                assert err <= max(2 * base, 2e-3), (name, d, n, m, causal, err, base)
