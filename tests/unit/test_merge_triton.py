"""The fused Triton merge (`megatron_mesh.common.merge_triton`) against today's torch merge
(`merge.merge_into_torch`) and against the merge written out from its definition
(out = sum_j exp(lse_j - L) out_j, L = logsumexp_j lse_j): on CPU through Triton's
interpreter (TRITON_INTERPRET=1), on a GPU (`gpu` marker) compiled. Triton is in the dev
extra (setup.py): where it is missing these tests fail, never skip.
"""
from __future__ import annotations

import pytest
import torch

from megatron_mesh.common import merge, merge_triton


def partials(n: int, s: int, b: int, h: int, d: int, dtype: torch.dtype, device: str,
             seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """n partials (out [s, b, h, d] in dtype, lse [b, h, s] fp32); some rows of some
    partials are empty (lse -inf, out 0), as a fully masked row is."""
    g = torch.Generator().manual_seed(seed)
    result = []
    for j in range(n):
        out = torch.randn(s, b, h, d, generator=g).to(dtype)
        lse = torch.randn(b, h, s, generator=g) * 3
        if j % 2 == 0:
            empty = torch.rand(b, h, s, generator=g) < 0.2
            lse[empty] = float("-inf")
            out.permute(1, 2, 0, 3)[empty] = 0
        result.append((out.to(device), lse.to(device)))
    return result


def by_definition(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """The merged (out fp32, lse) from the formula, all partials at once (fp64)."""
    lses = torch.stack([lse.double() for _, lse in parts])  # [n, b, h, s]
    total = torch.logsumexp(lses, 0)
    w = torch.exp(lses - total).nan_to_num(nan=0.0)  # [n, b, h, s]
    outs = torch.stack([o.double() for o, _ in parts])  # [n, s, b, h, d]
    out = (outs * w.permute(0, 3, 1, 2).unsqueeze(-1)).sum(0)
    return out, total


def run(device: str, dtype: torch.dtype, layout: str) -> None:
    s, b, h, d = 24, 2, 3, 40  # head dim not a power of 2: the kernel masks the tail
    parts = partials(4, 16, b, h, d, dtype, device)
    if layout == "transposed":  # out as a [b, h, s, d]-dense view, lse a strided view
        parts = [(o.permute(1, 2, 0, 3).contiguous().permute(2, 0, 1, 3),
                  lse.transpose(0, 1).contiguous().transpose(0, 1)) for o, lse in parts]
    rows = slice(5, 21)  # the accumulators' middle rows
    got = merge.empty_accumulators(s, b, h, d, torch.device(device))
    want = merge.empty_accumulators(s, b, h, d, torch.device(device))
    for out, lse in parts:
        merge_triton.merge_into(got[0][rows], got[1][..., rows], out, lse)
        merge.merge_into_torch(want[0][rows], want[1][..., rows], out, lse)
    torch.testing.assert_close(got[1], want[1], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)
    ref_out, ref_lse = by_definition(parts)
    torch.testing.assert_close(got[0][rows].double(), ref_out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[1][..., rows].double(), ref_lse, rtol=1e-6, atol=1e-6)
    assert torch.equal(got[0][:5], torch.zeros_like(got[0][:5]))  # rows outside untouched
    assert torch.isinf(got[1][..., 21:]).all()


@pytest.mark.parametrize("layout", ["dense", "transposed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_merge_in_the_interpreter(monkeypatch, dtype: torch.dtype, layout: str) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    run("cpu", dtype, layout)
    # merge.merge_into takes the kernel where it is available (here: the interpreter)
    acc = merge.empty_accumulators(4, 1, 2, 8, torch.device("cpu"))
    assert merge_triton.available(acc[0])
    monkeypatch.setenv("MESH_TRITON_MERGE", "0")
    assert not merge_triton.available(acc[0])


def test_shape_mismatch_is_a_value_error(monkeypatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    acc_o, acc_l = merge.empty_accumulators(4, 1, 2, 8, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"merge: out \(3, 1, 2, 8\)"):
        merge_triton.merge_into(acc_o, acc_l, torch.zeros(3, 1, 2, 8), torch.zeros(1, 2, 3))


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["dense", "transposed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_merge_on_gpu(monkeypatch, dtype: torch.dtype, layout: str) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    run("cuda", dtype, layout)
