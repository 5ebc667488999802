"""`cost_models.tile_calls` in closed form against the grouping itself: for every rank of every
grid up to 12 ranks, each schedule and pass, causal or full, the diagonal folded or not,
uncapped and with every cap on the rows a call concatenates that binds at these sizes, the
blocks the schedule has on hand together (listed here pair by pair, as the schedules
form them) go through `calls.groups.group_calls` on real dense blocks, and the calls made
and their shapes equal the model's."""
from __future__ import annotations

import pytest
import torch

from megatron_mesh.calls.groups import group_calls
from megatron_mesh.calls.layout import AttentionMask, block_for
from megatron_mesh.cost_models.tile_calls import (
    CallShape,
    backward_calls,
    call_shapes,
    forward_calls,
    group_tokens,
    piece_limit,
)
from megatron_mesh.layer_plan import Schedule

S = 8  # rows of a chunk (halves of 4)


def pair_groups(rows: int, cols: int, schedule: str, rank: int, phase: str) -> list[list]:
    """The (x, y) blocks rank (i, j) computes together, as the schedules list them."""
    if Schedule(schedule).runs_gathered(rows, cols):
        schedule = "gathered"
    i, j = divmod(rank, cols)
    row = [i * cols + c for c in range(cols)]
    col = [r * cols + j for r in range(rows)]
    me = rank
    if schedule == "gathered":
        if phase == "forward":
            return [[(x, y) for y in col] for x in row]
        return [[(me, me)], *[[(x, y) for y in col] for x in row if x != me],
                [(me, y) for y in col if y != me]]
    if schedule == "streamed_kv":
        groups = [[(me, me)]]
        for t in range(rows):
            y = col[(i - t) % rows]
            xs = [x for x in row if not (t == 0 and x == me)]
            groups += [[(x, y)] for x in xs] if phase == "backward" else [[(x, y) for x in xs]]
        return groups
    off = [r for r in range(rows) if r != i]
    later = {col[r] for r in off[(rows - 1) // 2:]} if phase == "backward" else set()
    groups = [[(me, me)]]
    for t in range(cols):
        x = row[(j - t) % cols]
        groups.append([(x, y) for y in col if not (t == 0 and (y == me or y in later))])
    return groups + ([[(me, y) for y in sorted(later)]] if later else [])


def shape_of(call) -> CallShape:
    half = lambda p: 2 * p.size // S  # noqa: E731
    return CallShape(tuple(half(p) for p in call.q), tuple(half(p) for p in call.kv))


@pytest.mark.parametrize("cap", [None, 4, 8, 12, 20, 28])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("folded", [True, False])
@pytest.mark.parametrize("schedule", ["gathered", "streamed_kv", "streamed_q"])
def test_closed_form_counts_the_grouped_calls(schedule: str, folded: bool, causal: bool,
                                              cap: int | None) -> None:
    """cap: the most rows a call concatenates (None: no cap; 4: one half per call)."""
    cpu = torch.device("cpu")
    chunk = None if cap is None else S
    limit = piece_limit(chunk, cap)
    for p in (1, 2, 3, 4, 6, 8, 12):
        mask = AttentionMask(causal, ranks=p)
        for rows in (r for r in range(1, p + 1) if p % r == 0):
            cols = p // rows
            for phase, model in (("forward", forward_calls), ("backward", backward_calls)):
                shapes = set()
                for rank in range(p):
                    calls = []
                    for group in pair_groups(rows, cols, schedule, rank, phase):
                        xs = list(dict.fromkeys(x for x, _ in group))
                        ys = list(dict.fromkeys(y for _, y in group))
                        blocks = [(xs.index(x), ys.index(y), block_for(x, y, S, mask, cpu))
                                  for x, y in group]
                        calls += group_calls(blocks, folded, limit=cap) if blocks else []
                        if cap is not None:
                            assert all(len(side) == 1 or sum(p.size for p in side) <= cap
                                       for c in calls for side in (c.q, c.kv)), calls
                    want = model(rows, cols, causal, schedule, rank=rank, bottom_right=folded,
                                 grouped=True, chunk_tokens=chunk, cap_tokens=cap)
                    assert len(calls) == want, (p, rows, cols, rank, phase, len(calls), want)
                    shapes |= {shape_of(c) for c in calls}
                assert shapes == call_shapes(rows, cols, causal, schedule, phase, folded,
                                             limit), (p, rows, cols, phase)


@pytest.mark.parametrize("value", ["0", "-8", "8K", ""])
def test_a_bad_cap_in_the_environment_is_named(value: str, monkeypatch) -> None:
    monkeypatch.setenv("MESH_GROUP_TOKENS", value)
    with pytest.raises(ValueError, match=f"MESH_GROUP_TOKENS={value!r} is not a positive"):
        group_tokens()


def test_the_cap_in_half_chunks() -> None:
    """16K keys: 16 halves of 2K-token chunks, 4 of 8K; a cap below one half: 0 (one piece
    a call); no chunk size: no cap."""
    assert piece_limit(4096, 16384) == 8
    assert piece_limit(8192) == 4 and piece_limit(2048) == 16
    assert piece_limit(4096, 1000) == 0 and piece_limit(None) is None
