"""Where packed documents go: `place_documents`, the search for a balanced
`DocumentPlacement` (the value: masks/document_placement.py; docs/placement.md).

`place_documents` keeps a document whole on one rank when it fits, and splits a document
too long or too heavy for one rank zigzag over a group of consecutive ranks (2g nearly equal
pieces, member k gets pieces k and 2g-1-k), the fewest ranks that balance allows. Every rank
holds exactly T / P tokens; the causal work (query, key pairs within documents) is balanced.

Algorithm (python ints only, deterministic, from the lengths alone; C = T / P tokens per rank,
W(L) = L(L+1)/2 the causal work of a whole document, "density" = work per token = (L+1)/2):

1. Plan: a document stays whole if it fits C and its work plus light filler for the rest of
   the rank (at the mean density of the documents lighter than the mean) stays within the
   mean work per rank (+5%); else it goes to the fewest g ranks whose share (L/g tokens, W/g
   work) plus filler does. g above one node (`gpus_per_node`) is rounded up to whole nodes.
2. Groups: split documents, largest group first, zigzag (2g nearly equal pieces, member k
   takes pieces k and 2g-1-k) over the window of g consecutive ranks with room and the least
   work so far, inside one node when g fits one (else node-aligned), preferring windows that
   fill no rank completely. Where the window would push a member past the mean work (+5%,
   with light filler: it overlaps other split documents), a larger group: the size whose
   share fits beside the window's busiest member (at most 4 sizes tried).
3. Sweep: the ranks in order, each aiming at (work left) / (ranks left). A rank first
   continues the documents cut at the end of the rank before it; then takes dense documents
   whole (best fit: the longest whose work, with the lightest documents filling the rest of
   its room, stays within the target); when none fits and the target is still out of reach,
   the tokens of the densest document that reach it (a cut); then the lightest documents,
   whole, the last one cut to fill exactly C tokens. So at most two documents (a dense one,
   a light one) cross each rank boundary, onto the next rank. The last rank of a node cuts
   no dense document and finishes a dense one carried onto it when that keeps it within
   the mean work + 5%, past its target if need be: a dense document's rows would cross the
   node's links (8x slower than NVLink on today's clusters); only the light one cut to
   fill the rank may.
4. Cuts are folded, not plain: a document over consecutive ranks gives each a front piece
   and a back piece of half its share ("zigzag with unequal pieces"), so each rank's work is
   its tokens times the document's density, whatever the shares. A plain cut would give the
   rank holding the end of the document most of its work (position p sees p + 1 keys).
5. Refine: while the busiest rank is more than 10% above the mean (the promise; steps 1-4
   aim at 5%), the document with the most work on it gets a group size that takes the
   excess off, and 2-4 rerun (at most 12 times); the best placement is kept. Refining
   down to 5% instead spread two documents of a log-normal mix over all 16 ranks of two
   nodes for 1.013x instead of 1.067x, at 2x the layer's modelled time.
"""
from __future__ import annotations

import bisect
import itertools
import math
import operator

from megatron_mesh.masks.document_placement import (
    DocumentPlacement,
    Run,
    check_total,
    document_work,
    lengths_from_cu_seqlens,
    positive_int,
    run_work,
)

BALANCE_TOLERANCE = 0.05  # group sizes and whole documents aim at 1.05 x the mean work
# rerun with a larger group only when the busiest rank is above 1.10 x mean (the promise):
# a larger group buys a few percent of balance with rows that cross ranks, often nodes
REFINE_TOLERANCE = 0.10
MAX_REFINEMENTS = 12
GROUP_ATTEMPTS = 4  # group sizes tried for a split document that overlaps others
WHOLE_SLACK = 0.02  # a dense document stays whole if it overshoots a rank's target by this much


def place_documents(cu_seqlens, cp_size: int, gpus_per_node: int | None = None
                    ) -> DocumentPlacement:
    """Document-aware placement of a packed sequence (the module docstring: the algorithm).

    `cu_seqlens`: int32 tensor or list / tuple of ints, [n + 1] cumulative lengths from 0,
    strictly increasing, total a multiple of 2 x cp_size. `gpus_per_node`: consecutive CP ranks
    per node (None: no node constraint); a split group stays inside one node when it fits.

    Guarantees: exactly T / P tokens per rank; every token once; deterministic from the
    lengths alone; one document of the whole length gives exactly `zigzag_placement(T, P)`.
    A document is one run on one rank unless it is too long or too heavy for one rank (then
    zigzag over g consecutive ranks, two runs each) or cut at a rank boundary to fill that
    rank's tokens or reach its work (at most two such per boundary; they continue on the next
    rank, stepping over a rank only where pieces of other split or cut documents fill it, as
    happens when ranks hold few tokens beside the documents).

    Balance: the busiest rank's work is within 10% of the mean when there are enough
    documents (`enough_documents`): the documents of at most C / 2 tokens (C = T / P) hold at
    least half of the tokens, so that every rank finds light filler to even out what the long
    documents give it. Measured on 400 random log-normal mixes (P 4..64, T 16K..256K, medians
    64..4096, sigma 0.5..2): <= 1.098 x mean on the 196 that meet it; one of the other 204
    went past 1.10 (1.1002, P = 64 with under one document per rank). Balance stops at 10%:
    refining to 5% (<= 1.062 on the same mixes) spread long documents over more ranks and
    nodes, which cost more time than the few percent of compute it saved. Tests also cover
    one 32K document beside many short ones, all short, many equal and 1-token documents.
    """
    lengths = lengths_from_cu_seqlens(cu_seqlens)
    cp_size = positive_int("cp_size", cp_size)
    if gpus_per_node is not None:
        gpus_per_node = positive_int("gpus_per_node", gpus_per_node)
    check_total(sum(lengths), cp_size)
    return _Placer(lengths, cp_size, gpus_per_node).place()


def enough_documents(lengths, cp_size: int) -> bool:
    """Whether `place_documents` promises balance (busiest rank within 10% of the mean): the
    documents of at most C / 2 tokens (C = T / P) hold at least half of the T tokens."""
    total = sum(lengths)
    half_rank = total // cp_size // 2
    return 2 * sum(n for n in lengths if n <= half_rank) >= total


class _Placer:
    """One placement problem: plan group sizes, place, refine (module docstring)."""

    def __init__(self, lengths: tuple[int, ...], cp_size: int, gpus_per_node: int | None):
        self.lengths = lengths
        self.cp_size = cp_size
        self.node = gpus_per_node if gpus_per_node and gpus_per_node < cp_size else cp_size
        self.capacity = sum(lengths) // cp_size
        self.mean_work = _total_work(lengths) / cp_size
        self.filler_density = self.light_density()

    def light_density(self) -> float:
        """Mean work per token of the documents lighter than the mean (the filler)."""
        mean_density = self.mean_work / self.capacity
        light = [n for n in self.lengths if n + 1 <= 2 * mean_density]
        tokens = sum(light)
        return _total_work(light) / tokens if tokens else mean_density

    def planned_sizes(self) -> dict[int, int]:
        """Group size of every document to split (`planned_size` > 1). Below the length where
        a whole document and its filler reach the mean work (a root of that quadratic) every
        document stays whole, so only the longer ones are checked one by one."""
        density, bound = self.filler_density, self.mean_work * (1 + BALANCE_TOLERANCE)
        linear = 2 * density - 1  # L(L+1)/2 + (C - L) density <= bound  <=>  L^2 - linear L <= ...
        discriminant = linear * linear + 8 * (bound - self.capacity * density)
        whole = (linear + math.sqrt(discriminant)) / 2 if discriminant >= 0 else 0.0
        shortest_checked = min(self.capacity, int(whole) - 1)
        sizes = {}
        for doc, length in enumerate(self.lengths):
            if length > shortest_checked and (g := self.planned_size(length)) > 1:
                sizes[doc] = g
        return sizes

    def place(self) -> DocumentPlacement:
        """Steps 1-5: plan, assign, refine; the placement with the least busy busiest rank."""
        sizes = self.planned_sizes()
        best = None
        for _ in range(MAX_REFINEMENTS):
            runs, works = _Assignment(self, sizes).run()
            busiest = max(works)
            if best is None or busiest < best[0]:
                best = (busiest, runs)
            if busiest <= (1 + REFINE_TOLERANCE) * self.mean_work:
                break
            found = self.heaviest_document(runs[works.index(busiest)], sizes)
            if found is None:
                break
            doc, share = found
            sizes[doc] = self.larger_size(doc, sizes.get(doc, 1), share, busiest - self.mean_work)
        runs = tuple(tuple(sorted(r)) for r in best[1])
        return DocumentPlacement(self.cp_size, self.lengths, runs)

    def allowed_size(self, g: int) -> int:
        """g rounded up to whole nodes when it exceeds one node; at most P."""
        if g > self.node:
            g = -(-g // self.node) * self.node
        return min(g, self.cp_size)

    def planned_size(self, length: int) -> int:
        """The fewest ranks whose share of the document, plus filler of the light documents'
        density for the rest of each member's tokens, stays within the mean work per rank."""
        if length <= self.capacity and (
                document_work(length) + (self.capacity - length) * self.filler_density
                <= self.mean_work * (1 + BALANCE_TOLERANCE)):
            return 1
        density = (length + 1) / 2
        g = max(2, -(-length // self.capacity))
        while g < self.cp_size:
            share = length / g
            if share * density + (self.capacity - share) * self.filler_density <= self.mean_work:
                break
            g += 1
        return self.allowed_size(g)

    def larger_size(self, doc: int, g: int, share: int, excess: float) -> int:
        """A group size for `doc` whose share takes `excess` work off the busiest rank (which
        holds `share` of its work), at least the next size."""
        work = document_work(self.lengths[doc])
        wanted = math.ceil(work / max(share - excess, work / self.cp_size, 1))
        return self.allowed_size(max(g + 1, wanted))

    def heaviest_document(self, runs: list[Run], sizes: dict[int, int]) -> tuple[int, int] | None:
        """The document with the most work on a rank (and that work) among those that can
        still take a larger group."""
        work_of: dict[int, int] = {}
        for doc, first, n in runs:
            work_of[doc] = work_of.get(doc, 0) + run_work(first, n)
        candidates = [d for d in work_of if sizes.get(d, 1) < self.cp_size]
        if not candidates:
            return None
        doc = max(candidates, key=lambda d: (work_of[d], -d))
        return doc, work_of[doc]


class _Assignment:
    """Steps 2-4 for given group sizes: groups, then one sweep over the ranks in order."""

    def __init__(self, placer: _Placer, sizes: dict[int, int]):
        self.placer = placer
        self.lengths = placer.lengths
        self.sizes = sizes
        count, ranks = len(placer.lengths), placer.cp_size
        self.runs: list[list[Run]] = [[] for _ in range(ranks)]
        self.room = [placer.capacity] * ranks
        self.works = [0] * ranks
        self.rest = list(placer.lengths)  # tokens of each document not placed yet
        self.front = [0] * count  # next free position from the start (folds)
        self.back = list(placer.lengths)  # end of the free positions (folds)
        self.held: dict[tuple[int, int], list[int]] = {}  # (rank, document) -> indices of its runs

    def run(self) -> tuple[list[list[Run]], list[int]]:
        pool = []
        for doc in sorted(self.sizes, key=lambda d: (-self.sizes[d], -self.lengths[d], d)):
            if not self.place_group(doc, self.sizes[doc]):
                pool.append(doc)
        pool += [d for d in range(len(self.lengths)) if d not in self.sizes]
        pool.sort()
        pool.sort(key=self.lengths.__getitem__, reverse=True)  # longest first, then by index
        _Sweep(self, pool).run()
        return self.runs, self.works

    def place_group(self, doc: int, g: int) -> bool:
        """Zigzag over a window of g consecutive ranks; where every window with room would
        push a member past the mean work (+5%, counting light filler for its free room: the
        window overlaps other split documents), over the next larger group that does not, if
        any (`sizes` records it). False if no window has room."""
        fallback = None
        size = g
        for attempt in range(GROUP_ATTEMPTS):
            pieces = _nearly_equal(self.lengths[doc], 2 * size)
            pairs = [(pieces[k], pieces[2 * size - 1 - k]) for k in range(size)]
            start = self.best_window(size, [head + tail for head, tail in pairs])
            if start is None:  # no room: shares that fit the roomiest rank
                wanted = -(-self.lengths[doc] // max(1, max(self.room)))
            elif self.fits_work(start, pairs, doc):
                break
            else:
                fallback = fallback or (start, pairs, size)
                wanted = self.size_beside(doc, start, size)
            if size == self.placer.cp_size or attempt == GROUP_ATTEMPTS - 1:
                if fallback is None:
                    return False
                start, pairs, size = fallback
                break
            size = self.placer.allowed_size(max(size + 1, wanted))
        self.sizes[doc] = size
        for k, (head, tail) in enumerate(pairs):
            self.take(doc, start + k, head, tail)
        return True

    def size_beside(self, doc: int, start: int, g: int) -> int:
        """The group size whose share fits beside the busiest member of the window (its
        work so far), within the mean work (+5%): a jump instead of one size at a time."""
        placer = self.placer
        free = placer.mean_work * (1 + BALANCE_TOLERANCE) - max(self.works[start:start + g])
        work = document_work(self.lengths[doc])
        return math.ceil(work / max(free, work / placer.cp_size, 1))

    def fits_work(self, start: int, pairs: list[tuple[int, int]], doc: int) -> bool:
        """Whether every member of the window stays within the mean work (+5%) with its share
        and light filler for the rest of its room."""
        placer, length = self.placer, self.lengths[doc]
        limit = placer.mean_work * (1 + BALANCE_TOLERANCE)
        density = (length + 1) / 2
        for k, (head, tail) in enumerate(pairs):
            rank = start + k
            share = head + tail
            if self.works[rank] + share * density + (self.room[rank] - share) * placer.filler_density > limit:
                return False
        return True

    def best_window(self, g: int, shares: list[int]) -> int | None:
        """The first rank of the window of g consecutive ranks with room for `shares` and the
        least work so far, preferring windows that fill no rank entirely (a full rank would
        break a later cut's span in two); None if none has room."""
        prefix = list(itertools.accumulate(self.works, initial=0))
        starts = sorted(self.window_starts(g), key=lambda s: (prefix[s + g] - prefix[s], s))
        chosen = None
        for start in starts:
            rooms = self.room[start:start + g]
            if all(map(operator.ge, rooms, shares)):
                if not any(map(operator.eq, rooms, shares)):
                    return start
                chosen = start if chosen is None else chosen
        return chosen

    def window_starts(self, g: int) -> list[int]:
        """First ranks of windows of g consecutive ranks: inside one node when g fits one,
        else aligned to node starts."""
        node, ranks = self.placer.node, self.placer.cp_size
        if g <= node:
            return [s for s in range(ranks - g + 1) if s // node == (s + g - 1) // node]
        return list(range(0, ranks - g + 1, node))

    def take(self, doc: int, rank: int, head: int, tail: int) -> None:
        """Give `rank` the next `head` free positions from the start of `doc` and the last
        `tail` free positions from its end (a fold). A piece that continues a run the rank
        took of `doc` before extends that run."""
        earlier = self.held.setdefault((rank, doc), [])
        added = []
        for first, n in ((self.front[doc], head), (self.back[doc] - tail, tail)):
            if n:
                self.works[rank] += run_work(first, n)
                added.append(self.extend_run(rank, doc, earlier, first, n))
        earlier.extend(i for i in added if i is not None)
        self.front[doc] += head
        self.back[doc] -= tail
        self.rest[doc] -= head + tail
        self.room[rank] -= head + tail

    def extend_run(self, rank: int, doc: int, earlier: list[int], first: int, n: int) -> int | None:
        """Extend a run of `earlier` (indices into the rank's runs) that touches positions
        first .. first + n - 1, or append a new run; the new run's index, None if extended."""
        runs = self.runs[rank]
        for i in earlier:
            _, start, count = runs[i]
            if start + count == first or first + n == start:
                runs[i] = (doc, min(start, first), count + n)
                return None
        runs.append((doc, first, n))
        return len(runs) - 1

    def take_whole(self, doc: int, rank: int) -> None:
        """All of an untouched document to `rank`, one run."""
        n = self.lengths[doc]
        self.runs[rank].append((doc, 0, n))
        self.works[rank] += n * (n + 1) // 2
        self.rest[doc] = 0
        self.room[rank] -= n

    def take_share(self, doc: int, rank: int, tokens: int) -> None:
        """`tokens` of `doc` to `rank`: whole if all of it, else folded, the front and back
        pieces chosen to keep the used start and end of the document equally long."""
        if tokens == self.lengths[doc]:
            self.take_whole(doc, rank)
            return
        used_front, used_back = self.front[doc], self.lengths[doc] - self.back[doc]
        head = min(tokens, max(0, (tokens + used_back - used_front + 1) // 2))
        self.take(doc, rank, head, tokens - head)


class _Sweep:
    """Steps 3-4: the ranks in order. Each continues the documents cut at the end of the rank
    before it, then takes dense documents from the heavy end of the pool (whole, the largest
    that keeps its work target in reach of light filler; a cut of the densest when no whole one
    does), then the lightest documents, whole, the last one cut to fill its tokens exactly. A
    cut document continues on the next rank (folded over the consecutive ranks it spans)."""

    def __init__(self, assignment: _Assignment, pool: list[int]):
        self.a = assignment
        self.heavy = pool  # longest first
        self.light = pool[::-1]  # shortest first
        self.hi = 0
        self.lo = 0
        self.light_lengths = list(map(assignment.lengths.__getitem__, self.light))
        self.cum_tokens = list(itertools.accumulate(self.light_lengths, initial=0))
        self.cum_work = [(c + t) // 2 for c, t in zip(
            itertools.accumulate(map(operator.mul, self.light_lengths, self.light_lengths), initial=0),
            self.cum_tokens)]  # sum of n(n+1)/2 = (sum of n^2 + sum of n) / 2
        self.pool_work = float(self.cum_work[-1])
        self.light_index = dict(zip(self.light, range(len(self.light))))
        self.untouched = list(range(len(self.light)))  # union-find: k, or a lower index if touched
        self.touched = [False] * len(self.light)
        self.carried: list[tuple[int, bool]] = []  # (document, heavy) cut on the rank before

    def run(self) -> None:
        a, ranks = self.a, self.a.placer.cp_size
        for rank in range(ranks):
            if a.room[rank] == 0:
                continue
            target = (sum(a.works[rank:]) + self.pool_work) / (ranks - rank)
            self.node_end = (rank + 1) % a.placer.node == 0
            self.continue_carried(rank, target)
            self.take_heavy(rank, target)
            self.fill_light(rank)

    def continue_carried(self, rank: int, target: float) -> None:
        """The documents cut on the rank before continue here: the light one first (what is
        left of it, leaving a token for a dense one when one is carried too), then the dense
        one (whole if that stays within the target, else cut again)."""
        a = self.a
        carried, self.carried = self.carried, []
        dense = [doc for doc, heavy in carried if heavy]
        for doc in (doc for doc, heavy in carried if not heavy):
            room = a.room[rank] - (1 if dense and a.room[rank] > 1 else 0)
            if room:
                self.give(doc, rank, min(a.rest[doc], room), heavy=False)
            else:
                self.carried.append((doc, False))
        for doc in dense:
            if a.room[rank]:
                self.take_heavy_doc(rank, doc, target)
            else:
                self.carried.append((doc, True))

    def density(self, doc: int) -> float:
        return (self.a.lengths[doc] + 1) / 2

    def give(self, doc: int, rank: int, tokens: int, heavy: bool) -> None:
        if self.a.rest[doc] == self.a.lengths[doc]:
            k = self.light_index[doc]
            self.untouched[k] = k - 1
            self.touched[k] = True
        self.a.take_share(doc, rank, tokens)
        self.pool_work -= tokens * self.density(doc)
        if self.a.rest[doc]:
            self.carried.append((doc, heavy))

    def light_work(self, tokens: int) -> float:
        """Work of the next `tokens` tokens from the light end (densities, interpolated)."""
        if tokens <= 0:
            return 0.0
        self.skip_used_light()
        lo = self.lo
        doc = self.light[lo]
        used = self.a.lengths[doc] - self.a.rest[doc]
        start = self.cum_tokens[lo] + used
        return self.work_upto(start + tokens) - self.cum_work[lo] - used * (self.a.lengths[doc] + 1) / 2

    def work_upto(self, offset: int) -> float:
        """Work of the first `offset` tokens of the pool, shortest documents first."""
        k = min(bisect.bisect_right(self.cum_tokens, offset) - 1, len(self.light) - 1)
        return self.cum_work[k] + (offset - self.cum_tokens[k]) * (self.a.lengths[self.light[k]] + 1) / 2

    def next_heavy(self) -> int | None:
        """The densest document not placed yet (untouched or cut)."""
        while self.hi < len(self.heavy) and self.a.rest[self.heavy[self.hi]] == 0:
            self.hi += 1
        return self.heavy[self.hi] if self.hi < len(self.heavy) else None

    def skip_used_light(self) -> None:
        while self.lo < len(self.light) - 1 and self.a.rest[self.light[self.lo]] == 0:
            self.lo += 1

    def take_heavy(self, rank: int, target: float) -> None:
        """Whole dense documents while they keep the target in reach, then one cut."""
        a, slack = self.a, WHOLE_SLACK * target
        while a.room[rank]:
            room, need = a.room[rank], target - a.works[rank]
            filler = self.light_work(room)
            if filler >= need - slack:
                return
            doc = self.best_fit(room, need, slack, filler)
            if doc is not None:
                self.give(doc, rank, a.lengths[doc], heavy=True)
                continue
            doc = self.next_heavy()
            if doc is not None and a.rest[doc] == a.lengths[doc] and not self.node_end:
                self.cut_heavy(rank, doc, need, filler)
            return

    def take_heavy_doc(self, rank: int, doc: int, target: float) -> None:
        """What is left of `doc`, whole if that stays within the target, else the tokens
        that reach it (at least one: a cut document keeps to consecutive ranks)."""
        a = self.a
        room, rest, need = a.room[rank], a.rest[doc], target - a.works[rank]
        limit = need + WHOLE_SLACK * target
        if self.node_end:  # rather than send its rows to the next node: up to the mean + 5%
            limit = max(limit, (1 + BALANCE_TOLERANCE) * a.placer.mean_work - a.works[rank])
        if rest <= room and rest * self.density(doc) + self.light_work(room - rest) <= limit:
            self.give(doc, rank, rest, heavy=True)
        else:
            self.cut_heavy(rank, doc, need, self.light_work(room))

    def cut_heavy(self, rank: int, doc: int, need: float, filler: float) -> None:
        """The tokens of `doc` that, with light filler for the rest of the room, reach `need`."""
        a = self.a
        room = a.room[rank]
        gain = self.density(doc) - filler / room  # work per token of heavy over light
        wanted = (need - filler) / gain if gain > 0 else room
        carried = a.rest[doc] < a.lengths[doc]  # keep a cut document on consecutive ranks
        tokens = min(room, a.rest[doc], max(1 if carried else 0, round(wanted)))
        if tokens >= 1:
            self.give(doc, rank, tokens, heavy=True)

    def best_fit(self, room: int, need: float, slack: float, filler: float) -> int | None:
        """The longest untouched document that, whole with light filler for the rest of the
        room, stays within `need` (+ slack), provided `need` is then still in reach (the rest
        of the room holding the densest document); None if no document fits."""
        a, light = self.a, self.light
        densest = self.next_heavy()
        if densest is None:
            return None
        if a.rest[densest] == a.lengths[densest] != light[self.lo]:
            length = a.lengths[densest]  # the densest whole fits: the common case early on
            if length <= room and document_work(length) + self.light_work(room - length) <= need + slack:
                return densest
        k = self.longest_within(room, need + slack, filler / room)
        if k is None:
            return None
        length = self.light_lengths[k]
        if need - slack - document_work(length) > (room - length) * self.density(densest):
            return None  # whole, it would leave the target out of reach: cut the densest instead
        return light[k]

    def longest_within(self, room: int, limit: float, filler_density: float) -> int | None:
        """Index (in `light`) of the longest untouched document of at most `room` tokens whose
        work plus light filler for the rest of the room stays within `limit`: the bound on
        its length solves L(L+1)/2 + (room - L) x filler density = limit, then a few exact
        checks step down through the untouched documents."""
        linear = 2 * filler_density - 1
        discriminant = linear * linear + 8 * (limit - room * filler_density)
        if discriminant < 0:
            return None
        bound = min(room, int((linear + math.sqrt(discriminant)) / 2))
        k = self.untouched_at_or_below(bisect.bisect_right(self.light_lengths, bound) - 1)
        for _ in range(4):
            if k is None or k <= self.lo:
                return None
            length = self.light_lengths[k]
            if document_work(length) + self.light_work(room - length) <= limit:
                return k
            k = self.untouched_at_or_below(k - 1)
        return None

    def untouched_at_or_below(self, k: int) -> int | None:
        """The largest index <= k (in `light`) of a document no rank holds a part of."""
        parent = self.untouched
        root = k
        while root >= 0 and parent[root] != root:
            root = parent[root]
        while k >= 0 and parent[k] != k:  # path compression
            parent[k], k = root, parent[k]
        return root if root >= 0 else None

    def fill_light(self, rank: int) -> None:
        """The lightest documents, whole, the last one cut to fill the rank exactly."""
        a = self.a
        while a.room[rank]:
            self.skip_used_light()
            if not self.take_light_run(rank):
                doc = self.light[self.lo]
                self.give(doc, rank, min(a.rest[doc], a.room[rank]), heavy=False)

    def take_light_run(self, rank: int) -> bool:
        """The untouched documents from the light end that fit the room whole, at once
        (prefix sums); False if the first one is touched or does not fit."""
        a, lo = self.a, self.lo
        end = bisect.bisect_right(self.cum_tokens, self.cum_tokens[lo] + a.room[rank], lo) - 1
        if end <= lo or any(self.touched[lo:end]):
            return False
        docs = self.light[lo:end]
        a.runs[rank].extend(zip(docs, itertools.repeat(0), self.light_lengths[lo:end]))
        work = self.cum_work[end] - self.cum_work[lo]
        a.works[rank] += work
        a.room[rank] -= self.cum_tokens[end] - self.cum_tokens[lo]
        self.pool_work -= work
        for doc in docs:
            a.rest[doc] = 0
        self.lo = end
        return True


def _total_work(lengths) -> int:
    """Causal work of whole documents: the sum of L(L+1)/2 (as (sum L^2 + sum L) / 2)."""
    return (sum(map(operator.mul, lengths, lengths)) + sum(lengths)) // 2


def _nearly_equal(total: int, parts: int) -> list[int]:
    """`total` cut into `parts` contiguous sizes differing by at most one (larger first)."""
    base, extra = divmod(total, parts)
    return [base + (1 if j < extra else 0) for j in range(parts)]
