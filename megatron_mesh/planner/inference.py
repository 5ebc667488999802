"""Inference pricing: the prefill (forward only) of every CP method and grid, and one decode
step (one new token for each of b sequences, over a context of S cached tokens) per method.

Prefill is the forward pass of the training plan (`search.Plan`): its forward bytes and
time per GPU, each method and grid as priced there.

A decode step, per layer and GPU (e = bytes of the cache's dtype, dv = d unless MLA):

    time = cache read / HBM + bytes sent / link + hops x hop latency

    mesh (any A x R x C)  cache cut by tokens (prefill: the zigzag share; decode steps round
                          robin), S / P tokens per GPU; one all-gather of the partial
                          (out, lse) in fp32: (P-1) b hq (dv + 1) 4 bytes, P-1 hops (a ring);
                          or ("all_reduce") a max of the lse and a sum of the rescaled
                          (out, weight), 2 (P-1)/P of b hq 4 and of b hq (dv + 1) 4 bytes,
                          two trees of 2 ceil(log2 P) hops each
    ring (p2p)            cache cut by tokens; the query and its partial (out, lse) pass
                          around the ring, P-1 sequential hops of b hq (d e + (dv + 1) 4)
    all_gather            cache cut by tokens and gathered for every step: (P-1) S/P b hkv
                          (d + dv) e bytes
    a2a                   cache cut by heads (hkv / P per GPU, whole heads repeated where
                          P > hkv); each GPU attends with hq / P heads, then an all-gather
                          of the outputs: (P-1) b (hq / P) dv e bytes, P-1 hops

The grid of the mesh does not change its decode step: the cache is cut by tokens, every
GPU holds all heads of its tokens, and the exchange runs over the whole CP group.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from megatron_mesh.cost_models.decode_traffic import decode_allreduce_bytes, decode_step_bytes
from megatron_mesh.layer_plan import FP32_BYTES
from megatron_mesh.planner.hardware import GB, Cluster
from megatron_mesh.planner.pricing.workload import Workload
from megatron_mesh.planner.search import Plan
from megatron_mesh.planner.topology import crosses_nodes

DEFAULT_HBM_BW = 3000.0  # achieved GB/s of an H100 SXM reading its memory
HOP_LATENCY_S = {False: 5e-6, True: 12e-6}  # one collective hop inside a node / across nodes


@dataclass(frozen=True)
class DecodeEstimate:
    """One decode step of one layer on one GPU."""

    method: str
    cache_bytes: int  # this GPU's KV cache of the context, for one layer
    sent_bytes: int
    hops: int
    read_s: float
    comm_s: float
    latency_s: float

    @property
    def time_s(self) -> float:
        return self.read_s + self.comm_s + self.latency_s


def decode_estimates(workload: Workload, cluster: Cluster, hbm_bw: float = DEFAULT_HBM_BW
                     ) -> list[DecodeEstimate]:
    """A decode step per method (module docstring), context workload.seq_length tokens
    (the window's keys only under a sliding window), batch workload.batch."""
    p, shape = cluster.gpus, workload.attention_shape()
    b, hq, hkv, d, dv, e = (shape.batch, shape.q_heads, shape.kv_heads, shape.head_dim,
                            shape.dv, shape.dtype_bytes)
    context = shape.seq_len
    if workload.window is not None and workload.window.left >= 0:
        context = min(context, workload.window.left + 1)
    cross = crosses_nodes([range(p)], cluster)
    link = cluster.bandwidth(cross)
    hop = HOP_LATENCY_S[cross]
    per_token = b * hkv * (d + dv) * e
    token_cut = -(-context // p) * per_token

    def est(method: str, cache: int, sent: int, hops: int) -> DecodeEstimate:
        return DecodeEstimate(method, cache, sent, hops, cache / (hbm_bw * GB), sent / link,
                              hops * hop)

    head_share = -(-hkv // p)  # K/V heads per GPU: 1 (repeated) where P > hkv
    tree = 2 * max(1, (p - 1).bit_length())  # hops of one tree all-reduce: 2 ceil(log2 P)
    out = [
        est("mesh all_gather", token_cut, decode_step_bytes(b, hq, dv, p), p - 1),
        est("mesh all_reduce", token_cut, decode_allreduce_bytes(b, hq, dv, p), 2 * tree),
        est("ring (p2p)", token_cut, (p - 1) * b * hq * (d * e + (dv + 1) * FP32_BYTES), p - 1),
        est("all_gather", token_cut, (p - 1) * token_cut, p - 1),
    ]
    if hq % p == 0:
        out.append(est("a2a", context * b * head_share * (d + dv) * e,
                       (p - 1) * b * (hq // p) * dv * e, p - 1))
    return out


def inference_report(result: Plan, hbm_bw: float = DEFAULT_HBM_BW) -> dict:
    """Prefill (forward) per method and grid from the training plan, and the decode step."""
    prefill = [{"method": e.label, "forward_bytes": e.bytes("forward"),
                "forward_s": e.time_s["forward"]} for e in result.estimates]
    decode = [{**asdict(d), "time_s": d.time_s}
              for d in decode_estimates(result.workload, result.cluster, hbm_bw)]
    best_prefill = min(prefill, key=lambda r: (r["forward_s"], r["forward_bytes"]))
    return {"prefill": prefill, "decode": decode, "best_prefill": best_prefill["method"],
            "best_decode": min(decode, key=lambda r: r["time_s"])["method"]}


def format_inference(result: Plan, hbm_bw: float = DEFAULT_HBM_BW) -> str:
    """The two tables of `inference_report`, per layer and GPU."""
    w, c = result.workload, result.cluster
    report = inference_report(result, hbm_bw)
    mib = 2 ** 20
    lines = [f"inference over {c.gpus} GPUs ({c.nodes} node(s) x {c.gpus_per_node}): context "
             f"S={w.seq_length}, batch {w.batch}, {w.num_heads} q / {w.num_kv_heads} kv heads "
             f"x {w.head_dim}, {w.dtype}; per layer and GPU",
             "", "prefill (forward only):",
             f"{'method':<16}{'fwd MiB':>10}{'fwd ms':>10}"]
    for r in report["prefill"]:
        mark = " *" if r["method"] == report["best_prefill"] else ""
        lines.append(f"{r['method']:<16}{r['forward_bytes'] / mib:>10.1f}"
                     f"{r['forward_s'] * 1e3:>10.3f}{mark}")
    lines += ["", f"decode step (one new token per sequence; HBM {hbm_bw:g} GB/s, hop latency "
              f"{HOP_LATENCY_S[False] * 1e6:g} us in a node, {HOP_LATENCY_S[True] * 1e6:g} us "
              "across):",
              f"{'method':<18}{'cache MiB':>11}{'sent KiB':>11}{'read us':>10}{'link us':>10}"
              f"{'hops us':>10}{'step us':>10}"]
    for r in report["decode"]:
        mark = " *" if r["method"] == report["best_decode"] else ""
        lines.append(f"{r['method']:<18}{r['cache_bytes'] / mib:>11.1f}"
                     f"{r['sent_bytes'] / 1024:>11.1f}{r['read_s'] * 1e6:>10.1f}"
                     f"{r['comm_s'] * 1e6:>10.1f}{r['latency_s'] * 1e6:>10.1f}"
                     f"{r['time_s'] * 1e6:>10.1f}{mark}")
    lines.append("* least time; the mesh's decode step is the same on every grid (the cache "
                 "is cut by tokens); generate --decode-exchange picks all_gather or all_reduce")
    return "\n".join(lines)
