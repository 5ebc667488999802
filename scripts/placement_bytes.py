"""Bytes per rank of packed documents: the THD layout against the document placement, per
mesh shape (the table of docs/schedules.md, "Packed documents placed whole").

THD cuts every document into 2P pieces over all ranks; it moves the dense layout's bytes of
the padded total (`mesh_traffic` of one sequence of sum(lengths rounded up to 2P)). The
placement moves the rows of documents that span ranks (`placement_traffic`, the most any
rank sends, equal to the exchange's counters).

    python scripts/placement_bytes.py --cp-sizes 8,16 --seq-length 65536
"""
from __future__ import annotations

import argparse

import megatron_mesh as mm
from megatron_mesh.planner.pricing.placed_documents import lognormal_lengths

MIB = 2**20


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cp-sizes", default="8,16")
    p.add_argument("--seq-length", type=int, default=65536)
    p.add_argument("--dist", default="1024:8192:0:128", help="MEDIAN:MAX:SEED:MIN")
    p.add_argument("--gpus-per-node", type=int, default=8)
    args = p.parse_args()
    median, longest, seed, shortest = (int(x) for x in args.dist.split(":"))
    lengths = lognormal_lengths(args.seq_length, median, longest, seed, shortest)
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    print(f"{len(lengths)} documents, log-normal median {median}, {shortest}..{longest}, "
          f"seed {seed}, S = {args.seq_length}; 32 q / 8 kv heads x 128, bf16, causal, "
          "default gradient exchange (mixed)\n")
    print("| P | mesh | THD MiB per rank | placed MiB per rank (busiest) | placed / THD |")
    print("|---|---|---|---|---|")
    for cp in (int(x) for x in args.cp_sizes.split(",")):
        placement = mm.place_documents(cu, cp, args.gpus_per_node)
        padded = sum(-(-n // (2 * cp)) * 2 * cp for n in lengths)
        thd_shape = mm.AttentionShape(padded, 1, 32, 8, 128, 2)
        shape = mm.AttentionShape(args.seq_length, 1, 32, 8, 128, 2)
        for r, c in mm.mesh_shapes(cp):
            thd = mm.mesh_traffic(thd_shape, r, c).total
            placed = mm.placement_traffic(shape, placement, r, c).total
            print(f"| {cp} | {r} x {c} | {thd / MIB:.1f} | {placed / MIB:.1f} | "
                  f"{placed / thd:.1%} |")
        print(f"\nP = {cp}: THD padded total {padded}; {placement.summary()}\n")


if __name__ == "__main__":
    main()
