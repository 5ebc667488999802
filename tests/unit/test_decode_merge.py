"""Decode's merge of the CP ranks' partials (`inference/decode.merge_partials`, the mesh's
`merge.merge_into` in CP-rank order) against the merge written out from its definition in
fp64: out = sum_p e^(lse_p - L) out_p, L = logsumexp_p lse_p; a row no partial sees stays
out 0, lse -inf."""
from __future__ import annotations

import pytest
import torch

from megatron_mesh.inference.decode import merge_partials


@pytest.mark.parametrize("ranks", [1, 2, 5])
def test_decode_merge_is_the_definition(ranks: int) -> None:
    g = torch.Generator().manual_seed(ranks)
    b, hq, dv = 3, 4, 8
    outs = torch.randn(ranks, b, hq, dv, generator=g)
    lses = torch.randn(ranks, b, hq, generator=g) * 4
    lses[0, 0, 1] = float("-inf")  # rank 0 sees no key of this row
    outs[0, 0, 1] = 0
    lses[:, 2, 3] = float("-inf")  # no rank does
    outs[:, 2, 3] = 0
    out, lse = merge_partials(outs, lses)
    want_lse = torch.logsumexp(lses.double(), 0)
    weights = torch.exp(lses.double() - want_lse).nan_to_num(nan=0.0)
    want = (weights[..., None] * outs.double()).sum(0)
    assert torch.equal(torch.isinf(lse), torch.isinf(want_lse))
    seen = torch.isfinite(want_lse)
    torch.testing.assert_close(lse[seen].double(), want_lse[seen], rtol=0, atol=1e-5)
    torch.testing.assert_close(out.double(), want, rtol=0, atol=1e-5)
    assert bool((out[2, 3] == 0).all())
    again = merge_partials(outs.clone(), lses.clone())
    assert torch.equal(again[0], out) and torch.equal(again[1], lse)  # the same bits
