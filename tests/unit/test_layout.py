"""Zigzag layout, block kinds, LSE merge and the D stand-in, in one process."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from megatron_mesh.calls.layout import AttentionMask, block_for, zigzag_chunks, zigzag_merge, zigzag_split
from megatron_mesh.common.merge import empty_accumulators, merge_into
from megatron_mesh.kernels import TorchFlashKernel
from megatron_mesh.masks.sink import add_sink
from megatron_mesh.schedules.delta import attention_delta, out_with_delta


@pytest.mark.parametrize("cp_size", [1, 2, 3, 8])
def test_zigzag_split_and_merge(cp_size: int) -> None:
    full = torch.arange(4 * cp_size * 3).view(4 * cp_size, 3)
    shares = zigzag_split(full, cp_size)
    sub = full.chunk(2 * cp_size)
    for r, share in enumerate(shares):
        a, b = zigzag_chunks(cp_size, r)
        assert torch.equal(share, torch.cat([sub[a], sub[b]]))
    assert torch.equal(zigzag_merge(shares), full)
    with pytest.raises(ValueError, match="divisible by 2"):
        zigzag_split(torch.zeros(2 * cp_size + 1), cp_size)


@pytest.mark.parametrize("cp_size", [1, 2, 4, 5])
def test_blocks_cover_exactly_the_causal_mask(cp_size: int) -> None:
    """The rows x keys each block computes, mapped back to global positions, tile the
    lower triangle (diagonal included) exactly once."""
    s = 4  # local rows per rank
    pos = zigzag_split(torch.arange(s * cp_size), cp_size)
    covered = torch.zeros(s * cp_size, s * cp_size, dtype=torch.int64)
    for x in range(cp_size):
        for y in range(cp_size):
            for call in block_for(x, y, s, AttentionMask(True, ranks=cp_size)).calls:
                qp, kp = pos[x][call.q_rows], pos[y][call.kv_rows]
                covered[qp.unsqueeze(1), kp.unsqueeze(0)] += call.seen().long()
    assert torch.equal(covered, torch.tril(torch.ones_like(covered)))


def test_merge_of_key_halves_equals_one_call() -> None:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(6, 2, 4, 16, generator=g) for _ in range(3))
    kernel = TorchFlashKernel()
    out, lse = kernel.forward(q, k, v, False, 0.25)
    acc_o, acc_l = empty_accumulators(6, 2, 4, 16, q.device)
    for keys in (slice(0, 2), slice(2, 6)):
        merge_into(acc_o, acc_l, *kernel.forward(q, k[keys], v[keys], False, 0.25))
    torch.testing.assert_close(acc_o, out, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(acc_l, lse, atol=1e-6, rtol=1e-6)


def test_the_log_sum_exp_merge_is_coded_once() -> None:
    """Every merge of partials (the tiles', the sink's, decode's) is common/merge.py's: no other
    module of the package forms a logaddexp."""
    root = Path(__file__).resolve().parents[2] / "megatron_mesh"
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in ("logaddexp", "logaddexp_"):
                found.append(str(path.relative_to(root)))
    assert found == ["common/merge.py"], found


def test_sink_merge_equals_the_softmax_with_one_more_logit() -> None:
    """add_sink (the mesh's merge of a partial of output 0) against the fp64 softmax over the
    scores and the sink's logit; a row that sees no key stays 0; the caller's lse is kept."""
    torch.manual_seed(0)
    s, b, h, n, dv = 5, 2, 3, 7, 4
    scores = torch.randn(b, h, s, n, dtype=torch.float64)
    scores[0, 1, 2] = float("-inf")  # a row that sees no key
    v = torch.randn(n, dv, dtype=torch.float64)
    offset = torch.randn(h, dtype=torch.float32)
    lse = torch.logsumexp(scores, -1)
    out = (torch.softmax(scores, -1).nan_to_num(0.0) @ v).permute(2, 0, 1, 3)  # [s, b, h, dv]
    logits = torch.cat([scores, offset.double()[None, :, None, None].expand(b, h, s, 1)], -1)
    want = (torch.softmax(logits, -1)[..., :n] @ v).permute(2, 0, 1, 3)
    kept = lse.float().clone()
    got, got_lse = add_sink(out.float(), kept, offset)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_lse.double(), torch.logsumexp(logits, -1), rtol=1e-5,
                               atol=1e-6)
    assert torch.equal(kept, lse.float())
    assert torch.equal(got[2, 0, 1], torch.zeros(dv))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stand_in_output_has_the_same_delta(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(1)
    dout, out = (torch.randn(5, 2, 3, 32, generator=g).to(dtype) for _ in range(2))
    dout[0, 0, 0] = 0  # a row with no gradient
    delta = attention_delta(dout, out)
    stand_in = out_with_delta(dout, delta)
    assert stand_in.dtype == dtype
    tol = 1e-6 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(attention_delta(dout, stand_in), delta, atol=tol, rtol=tol)
    assert stand_in[0, 0, 0].abs().max() == 0


def test_tile_gradients_with_the_whole_rows_out_and_lse_are_exact() -> None:
    """Backward over two key halves, each given the whole row's out / lse (or a stand-in
    with the same D), sums to the gradient of one call."""
    g = torch.Generator().manual_seed(2)
    q, k, v, dout = (torch.randn(6, 1, 2, 16, generator=g) for _ in range(4))
    kernel = TorchFlashKernel()
    out, lse = kernel.forward(q, k, v, False, 0.25)
    dq, dk, dv = kernel.backward(dout, q, k, v, out, lse, False, 0.25)
    stand_in = out_with_delta(dout, attention_delta(dout, out))
    dq_sum = torch.zeros_like(dq)
    for keys in (slice(0, 3), slice(3, 6)):
        dq_part, dk_part, dv_part = kernel.backward(dout, q, k[keys], v[keys], stand_in, lse,
                                                    False, 0.25)
        dq_sum += dq_part
        torch.testing.assert_close(dk_part, dk[keys], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(dv_part, dv[keys], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dq_sum, dq, atol=1e-5, rtol=1e-5)
