"""Long-context inference through the mesh (torch and torch.distributed only; never megatron).

    cache.py     one layer's share of the KV cache on one CP rank; which rank and slot each
                 token goes to (prefill: the zigzag share; decode: round robin by step)
    decode.py    one decode step's attention: a partial (out, lse) over this rank's share,
                 one all-gather of the partials over the CP group, the log-sum-exp merge, the
                 sink once after it
    decode_agreement.py  which decode calls the CP ranks agree on (once per step), and
                 the options agreed
    session.py   one generation's state on one rank: every layer's shard, the step
    prefill.py   the prompt's attention through `mesh_attention` with no autograd state, and
                 its K / V share written into the cache
    packed.py    the cache of packed prompts placed by `place_documents` (each document a
                 sequence; the placement's rows, then decode steps round robin)
    prompts.py   this rank's share of a batch of prompts: padded and cut by the zigzag, or
                 packed and placed by document
    sampling.py, continuations.py  the next token of each sequence; when each one stops

megatron/ holds the part that runs it on megatron-core (the generate command, its flags and
checkpoint, the GPTModel's layers with a cached core attention): it alone imports megatron.

The bytes of the prefill and of a decode step per rank, and the cache's bytes, are in
megatron_mesh/cost_models/decode_traffic.py (`cache_bytes` and `decode_step_bytes` re-exported here).

docs/inference.md describes the design.
"""
from ..cost_models.decode_traffic import cache_bytes, decode_step_bytes
from .cache import CacheLayout, KVShard
from .decode import decode_attention, local_partial, merge_partials
from .packed import PackedShard, prefill_packed
from .prefill import prefill_attention

__all__ = ["CacheLayout", "KVShard", "cache_bytes", "decode_attention", "decode_step_bytes",
           "local_partial", "merge_partials", "PackedShard", "prefill_attention",
           "prefill_packed"]
