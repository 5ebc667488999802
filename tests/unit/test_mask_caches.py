"""What a layer reads again is kept, bounded, and found by what decides it: a mask's slice
tables on the device (`masks/seen.layers_on`), and whether a mask's sparse exchange pays
(`attention.sparse_pays`, keyed by the mask's digests, not by comparing its value)."""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import megatron_mesh as mm
from megatron_mesh import attention
from megatron_mesh.cost_models.plan import resolve_plan
from megatron_mesh.masks.mask import Mask
from megatron_mesh.masks.seen import layers_on, sees
from megatron_mesh.masks.slices import SliceMask


class Copies(TorchDispatchMode):
    """Counts the copies between devices or dtypes dispatched inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in ("_to_copy", "copy_"):
            self.count += 1
        return func(*args, **(kwargs or {}))


def documents_mask(n: int, length: int) -> SliceMask:
    return SliceMask([(i * length, (i + 1) * length, i * length, (i + 1) * length, "causal")
                      for i in range(n)], n * length)


def test_slice_tables_go_to_the_device_once_per_mask():
    """`sees` on a device reads the mask's tables copied there by its first call: a second
    call (the next layer) copies nothing, and gives what the definition gives."""
    mask = SliceMask([(0, 8, 0, 8, "causal"), (8, 16, 0, 4, "full"), (8, 16, 8, 16, "causal")],
                     16)
    pos = torch.arange(16)
    want = torch.zeros(16, 16, dtype=torch.bool)
    for q0, q1, k0, k1, causal in ((0, 8, 0, 8, True), (8, 16, 0, 4, False),
                                   (8, 16, 8, 16, True)):
        i, j = pos[:, None], pos[None, :]
        want |= (i >= q0) & (i < q1) & (j >= k0) & (j < k1) & (~torch.tensor(causal) | (j <= i))
    assert torch.equal(sees(mask, pos, pos), want)
    device = torch.device("meta")
    layers_on.cache_clear()
    with Copies() as first:
        sees(mask, pos.to(device), pos.to(device))
    with Copies() as second:
        sees(mask, pos.to(device), pos.to(device))
    assert first.count > second.count == 2  # only the positions' own copies
    assert all(t.device == device for pair in layers_on(mask, device) for t in pair)
    assert layers_on.cache_info().maxsize is not None  # bounded


def test_sparse_pays_is_found_by_the_mask_digests(monkeypatch):
    """The decision is kept per shape, plan and `pays_key`: a mask built anew with the same
    slices (the next layer's, the next step's) finds it without pricing again and without
    comparing the masks' slices; the key is a few numbers whatever the mask's size; at most
    `SPARSE_PAYS_KEPT` decisions are kept."""
    shape = mm.AttentionShape(4096, 1, 8, 8, 64)
    plan = resolve_plan(shape, 2, 2)
    priced = []
    real = attention.sparse_traffic
    monkeypatch.setattr(attention, "sparse_traffic",
                        lambda *a, **kw: priced.append(1) or real(*a, **kw))
    compared = []
    real_eq = SliceMask.__eq__
    monkeypatch.setattr(SliceMask, "__eq__", lambda a, b: compared.append(1) or real_eq(a, b))
    attention._PAYS.clear()
    first = attention.sparse_pays(shape, plan, Mask(False, slices=documents_mask(256, 16)))
    again = attention.sparse_pays(shape, plan, Mask(False, slices=documents_mask(256, 16)))
    assert first == again and len(priced) == 1 and compared == []
    key = attention.pays_key(Mask(False, slices=documents_mask(256, 16)))
    assert len(repr(key)) < 100
    assert first is True  # 256 short documents: each rank needs few of the others' rows
    dense = attention.sparse_pays(shape, plan, Mask(False, slices=documents_mask(1, 4096)))
    assert dense is False and len(priced) == 2
    for n in range(attention.SPARSE_PAYS_KEPT + 3):
        attention.sparse_pays(shape, plan, Mask(False, slices=documents_mask(2 ** (n % 6), 64)
                                                if n < 6 else SliceMask(
            [(0, 4096 - n, 0, 4096 - n, "causal")], 4096)))
    assert len(attention._PAYS) == attention.SPARSE_PAYS_KEPT
