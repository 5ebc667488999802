"""The caches of block data stay bounded (`megatron_mesh/common/caches.py`): band masks by bytes,
whatever shapes packed documents bring."""
from __future__ import annotations

import torch

from megatron_mesh.calls import tile_slices
from megatron_mesh.common import caches


def band_from_definition(sq: int, sk: int, left: int) -> torch.Tensor:
    """[sq, sk] fp32: 0 where key j - query i - (sk - sq) lies in [-left, 0], else -inf."""
    offset = (torch.arange(sk)[None, :] - torch.arange(sq)[:, None]) - (sk - sq)
    seen = (offset <= 0) & (offset >= -left)
    return torch.zeros(sq, sk).masked_fill(~seen, float("-inf"))


def test_band_masks_kept_within_their_byte_bound() -> None:
    made = []

    def bias(shape: tuple[int, int], window: tuple[int, int], device: torch.device):
        made.append(shape)
        return tile_slices._band_bias.fn(shape, window, device)  # the real band mask

    kept = caches.BytesLRU(bias, max_bytes=1 << 20)  # 1 MiB: a few 256 x 256 fp32 masks
    cpu = torch.device("cpu")
    for n in range(64):  # shapes as documents' lengths bring them
        shape = (256, 256 + n)
        got = kept(shape, (16, 0), cpu)
        assert torch.equal(got, band_from_definition(*shape, 16)), shape
        assert kept.held <= 1 << 20
        assert sum(t.untyped_storage().nbytes() for t in kept.values()) == kept.held
    assert kept((256, 319), (16, 0), cpu) is kept((256, 319), (16, 0), cpu)  # reused
    too_big = kept((1024, 1024), (16, 0), cpu)  # 4 MiB: made, never kept
    assert too_big.shape == (1024, 1024) and kept.held <= 1 << 20
    assert made.count((1024, 1024)) == 1 and (1024, 1024) not in {k[0] for k in kept.entries}
    assert isinstance(tile_slices._band_bias, caches.BytesLRU)
    assert tile_slices._band_bias.max_bytes == tile_slices.BAND_MASK_BYTES == 64 << 20


def test_te_cu_seqlens_kept_for_a_bounded_number_of_lengths() -> None:
    """TE's dense calls' cu_seqlens [0, s, .., b s]: calls of a new length every micro-batch
    keep at most `CU_SEQLENS_KEPT` of them; a kept one is reused."""
    from megatron_mesh.kernels import te_fused

    cpu = torch.device("cpu")
    te_fused._cu_seqlens.cache_clear()
    for n in range(3 * te_fused.CU_SEQLENS_KEPT):
        got = te_fused.cu_seqlens(2, 100 + n, cpu)
        assert got.tolist() == [0, 100 + n, 2 * (100 + n)] and got.dtype == torch.int32
    assert te_fused._cu_seqlens.cache_info().currsize == te_fused.CU_SEQLENS_KEPT
    assert te_fused.cu_seqlens(2, 99 + 3 * te_fused.CU_SEQLENS_KEPT, cpu) is te_fused.cu_seqlens(
        2, 99 + 3 * te_fused.CU_SEQLENS_KEPT, cpu)
