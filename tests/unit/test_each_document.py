"""`mask.each_document`: a mask written over one document's positions, kept by every
document of a placement at its offset (what packed prompts prefill under)."""
from __future__ import annotations

import megatron_mesh as mm
from megatron_mesh.inference.packed import packed_mask
from megatron_mesh.masks.mask import each_document


def test_each_document_lays_the_mask_at_every_documents_offset():
    placement = mm.place_documents([0, 3, 8], 2)
    got = each_document(mm.prefix_lm_mask(10, 2), placement)
    assert got.placement is placement and not got.causal
    assert [s.as_tuple for s in got.slices.slices] == [
        (0, 2, 0, 2, "full"), (2, 3, 0, 2, "full"), (2, 3, 2, 3, "full"),
        (3, 5, 3, 5, "full"), (5, 8, 3, 5, "full"), (5, 8, 5, 8, "causal")]
    windowed = each_document(mm.Mask() & mm.sliding_window_mask(1), placement)
    assert windowed.slices.pairs == (3 + 2) + (5 + 4)  # each token and the one before it
    causal = each_document(mm.Mask(), placement)
    assert causal.slices.pairs == mm.documents_mask(placement).sequence_slices(8).pairs
    assert packed_mask(None, placement) == mm.documents_mask(placement)


def test_decode_refuses_a_mask_of_packed_documents():
    """A session's mask is the model's over one sequence's positions, of which decode reads
    a row per new token: a mask of packed documents (cu_seqlens or a placement) has no such
    row (it was read as one causal sequence, other documents seen), so the session refuses
    it when made, before any layer runs, naming the mask; the row refuses it too."""
    import pytest
    import torch

    from megatron_mesh.inference.cache import CacheLayout
    from megatron_mesh.inference.decode import visible
    from megatron_mesh.inference.session import InferenceSession

    layout, lengths = CacheLayout(2, 0, 8, 4), torch.tensor([5, 8])
    for mask in (mm.documents_mask([0, 3, 8]),
                 mm.documents_mask([0, 3, 8]) & mm.sliding_window_mask(2),
                 mm.documents_mask(mm.place_documents([0, 3, 8], 2)),):
        with pytest.raises(ValueError, match=r"attention_mask \(causal & .*documents.*\) packs "
                           "documents: decode reads a token's row over one sequence's"):
            InferenceSession(layout, lengths, attention_mask=mask)
        with pytest.raises(ValueError, match="packs documents"):
            visible(torch.tensor([6]), torch.arange(8)[:, None], None, mask)
    for mask in (None, mm.prefix_lm_mask(16, 4), mm.sliding_window_mask(3)):  # one sequence
        assert InferenceSession(layout, lengths, attention_mask=mask).batch == 2
