"""A call's runs (`calls/tile_runs.py`) as variable-length calls: each run one sequence.

A variable-length op (CUDA's flash op with cumulative lengths) takes many sequences in one
call, each query run against its concatenated key runs, under one rule for all of them:
so the runs are packed by rule (full, causal, each window) and, where runs of one rule
share query rows, into layers whose rows do not meet (`packs_of`; made once per call with
their index tensors and kept with it, `torch_flash.packs_on`). A pack gathers its query
rows and key rows (a copy; none where a pack is the call's rows in order), and its outputs
go back to their rows: written where one pack covers the call, else merged by log-sum-exp.
The backward gathers dout, out and the whole row's lse the same way and adds dq, dk, dv
back into the rows read. One call per pack and batch entry.

Shapes: q [sq, b, hq, d], k [sk, b, hkv, d], v [sk, b, hkv, dv], lse [b, hq, sq] fp32; the
op works on [t, h, d] with lse [h, t].
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..calls.tile_runs import CAUSAL_RUN, WINDOW, Run
from ..common.merge import merge_into

# forward(q, k, v, cu_q, cu_k, max_q, max_k, causal, window, scale) -> out [t, h, dv],
# lse [h, t]; backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, window,
# scale) -> dq, dk, dv
VarlenForward = Callable[..., tuple[torch.Tensor, torch.Tensor]]
VarlenBackward = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class Pack:
    """One variable-length call: sequences n = 0.. of query rows `rows[n]` against the
    concatenated key ranges `keys[n]`, `causal` (bottom-right) or flash's `window`."""

    rows: tuple[tuple[int, int], ...]
    keys: tuple[tuple[tuple[int, int], ...], ...]
    causal: bool
    window: tuple[int, int] | None

    @property
    def cu_q(self) -> tuple[int, ...]:
        return _cumulative(b - a for a, b in self.rows)

    @property
    def cu_k(self) -> tuple[int, ...]:
        return _cumulative(sum(e - c for c, e in ranges) for ranges in self.keys)

    def tensors(self, device: torch.device) -> dict[str, torch.Tensor]:
        """q_index, k_index (int64), cu_q, cu_k (int32) on `device`."""
        def span(ranges):
            return [i for a, b in ranges for i in range(a, b)]
        as_tensor = lambda x, dtype: torch.tensor(x, dtype=dtype, device=device)  # noqa: E731
        return {"q_index": as_tensor(span(self.rows), torch.int64),
                "k_index": as_tensor(span(r for ranges in self.keys for r in ranges),
                                     torch.int64),
                "cu_q": as_tensor(self.cu_q, torch.int32),
                "cu_k": as_tensor(self.cu_k, torch.int32)}


def _cumulative(lengths) -> tuple[int, ...]:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return tuple(out)


def packs_of(runs: tuple[Run, ...]) -> tuple[Pack, ...]:
    """The runs packed by rule, each rule's runs in layers whose query rows do not meet
    (first fit over runs ordered by q0)."""
    layers: dict[tuple, list[list[Run]]] = {}
    for run in sorted(runs, key=lambda r: (r.q0, r.q1)):
        rule = (run.rule == CAUSAL_RUN, run.window if run.rule == WINDOW else None)
        for layer in layers.setdefault(rule, []):
            if layer[-1].q1 <= run.q0:
                layer.append(run)
                break
        else:
            layers[rule].append([run])
    return tuple(Pack(tuple((r.q0, r.q1) for r in layer), tuple(r.keys for r in layer),
                      causal, window)
                 for (causal, window), found in layers.items() for layer in found)


def _whole(pack: Pack, sq: int) -> bool:
    """Whether the pack's query rows are the call's rows in order."""
    return pack.cu_q[-1] == sq and all(a == b for (_, a), (b, _) in
                                       zip(pack.rows, pack.rows[1:])) and pack.rows[0][0] == 0


def varlen_runs_forward(q, k, v, scale: float, packs: tuple[Pack, ...], tensors: list[dict],
                        op: VarlenForward) -> tuple[torch.Tensor, torch.Tensor]:
    """out [sq, b, hq, dv] in q's dtype, lse [b, hq, sq] fp32 of the packs (`tensors`: each
    pack's `Pack.tensors` on q's device); rows no pack reaches: 0 and -inf."""
    sq, b, hq, _ = q.shape
    one = len(packs) == 1 and _whole(packs[0], sq)
    out = torch.zeros(sq, b, hq, v.shape[-1], device=q.device,
                      dtype=q.dtype if one else torch.float32)
    lse = torch.full((b, hq, sq), float("-inf"), dtype=torch.float32, device=q.device)
    for pack, t in zip(packs, tensors):
        cu = (t["cu_q"], t["cu_k"], max(b_ - a for a, b_ in pack.rows),
              max(e - c for e, c in zip(pack.cu_k[1:], pack.cu_k)))
        for n in range(b):
            qn = q[:, n] if one else q[:, n].index_select(0, t["q_index"])
            kn, vn = (x[:, n].index_select(0, t["k_index"]) for x in (k, v))
            o, o_lse = op(qn, kn, vn, *cu, pack.causal, pack.window, scale)
            if one:
                out[:, n], lse[n] = o, o_lse
                continue
            part = torch.zeros(sq, 1, hq, o.shape[-1], dtype=o.dtype, device=q.device)
            part[:, 0].index_copy_(0, t["q_index"], o)
            part_lse = torch.full((1, hq, sq), float("-inf"), device=q.device)
            part_lse[0].index_copy_(1, t["q_index"], o_lse)
            merge_into(out[:, n:n + 1], lse[n:n + 1], part, part_lse)
    return out.to(q.dtype), lse


def varlen_runs_backward(dout, q, k, v, out, lse, scale: float, packs: tuple[Pack, ...],
                         tensors: list[dict], op: VarlenBackward
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv (the inputs' shapes and dtype) of `varlen_runs_forward`'s call; out and
    lse are the whole row's. Gradients add up in fp32 where the inputs are narrower."""
    acc = torch.float32 if q.element_size() < 4 else q.dtype
    dq, dk, dv = (torch.zeros(x.shape, dtype=acc, device=x.device) for x in (q, k, v))
    for pack, t in zip(packs, tensors):
        cu = (t["cu_q"], t["cu_k"], max(b_ - a for a, b_ in pack.rows),
              max(e - c for e, c in zip(pack.cu_k[1:], pack.cu_k)))
        for n in range(q.shape[1]):
            rows = lambda x: x[:, n].index_select(0, t["q_index"])  # noqa: E731
            kn, vn = (x[:, n].index_select(0, t["k_index"]) for x in (k, v))
            gq, gk, gv = op(rows(dout), rows(q), kn, vn, rows(out),
                            lse[n].index_select(1, t["q_index"]).contiguous(), *cu,
                            pack.causal, pack.window, scale)
            dq[:, n].index_add_(0, t["q_index"], gq.to(acc))
            dk[:, n].index_add_(0, t["k_index"], gk.to(acc))
            dv[:, n].index_add_(0, t["k_index"], gv.to(acc))
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
