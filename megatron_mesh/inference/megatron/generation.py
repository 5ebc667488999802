"""Generation on megatron-core's GPTModel with the mesh's context parallelism.

megatron-core's own inference (its inference contexts, KV cache and text-generation
controllers) keeps a whole KV cache on every rank and attends to it locally, which has no
place for a cache cut over the CP group; so this loop runs the GPTModel's own modules
(embedding, decoder layers, output layer; RoPE from its RotaryEmbedding's table) and puts
`CachedMeshAttention` in the core-attention slot, which holds the rank's cache shard
(`inference.InferenceSession`):

  prefill   the prompts, right-padded to a multiple of 2P, cut by the zigzag; one forward
            of the layers through the mesh, each layer's K / V share kept; the logits of
            each prompt's last token come from the rank that holds it (one all-reduce)
  decode    one new token per sequence, the same on every rank; each layer appends its
            K / V on one rank (round robin) and merges the P partial attentions
            (one all-gather of (out, lse) per layer)

Every CP rank computes the same logits and draws the same tokens (one seeded generator);
rank 0's choice is broadcast each step all the same, so the ranks never drift apart.
"""
from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel

from megatron_mesh.cost_models.decode_traffic import cache_bytes
from megatron_mesh.inference.cache import CacheLayout
from megatron_mesh.inference.continuations import Continuations
from megatron_mesh.inference.megatron.arguments import GenerateConfig
from megatron_mesh.inference.megatron.cached_attention import attach, cached_attention_spec
from megatron_mesh.inference.prompts import Packed, Padded
from megatron_mesh.inference.sampling import Sampling, next_tokens
from megatron_mesh.inference.session import DECODE, InferenceSession
from megatron_mesh.layer_plan import AttentionShape
from megatron_mesh.training.config.training_config import TrainingConfig
from megatron_mesh.training.job.device import has_cuda
from megatron_mesh.training.job.distributed import print_rank0
from megatron_mesh.training.model.gpt import gpt_model, layer_spec, transformer_config


def build_generation_model(args: TrainingConfig, vocab_size: int) -> GPTModel:
    """The driver's GPTModel (same config and layer spec, so its checkpoints load) with
    `CachedMeshAttention` as every layer's core attention, in eval mode."""
    model = gpt_model(args, vocab_size, transformer_config(args),
                      cached_attention_spec(layer_spec(args)))
    return model.eval()


@dataclass
class Runner:
    """The model's modules called in order, with RoPE at given global positions."""

    model: GPTModel
    max_positions: int  # position ids of learned embeddings are clamped below this
    rope: torch.Tensor | None  # [T, 1, 1, d] of positions 0 .. T - 1, or None (no RoPE)

    @classmethod
    def of(cls, model: GPTModel, positions: int, max_positions: int) -> Runner:
        rope = getattr(model, "rotary_pos_emb", None)
        table = rope.get_emb(positions) if rope is not None else None
        return cls(model, max_positions, table)

    def hidden(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """ids [b, s] at global positions [b, s] -> final hidden states [s, b, h]."""
        pos = positions.clamp(max=self.max_positions - 1)
        emb = self.model.embedding(input_ids=ids, position_ids=pos)
        rope = None
        if self.rope is not None:
            rope = self.rope[positions.t()].squeeze(-2).squeeze(-2)[:, :, None, :]  # [s, b, 1, d]
        return self.model.decoder(hidden_states=emb, attention_mask=None, rotary_pos_emb=rope)

    @property
    def width(self) -> int:
        """V_padded: the logits' width, from the output weight's shape (generation runs at
        TP = 1, so the weight holds every row)."""
        m = self.model
        weight = m.shared_embedding_or_output_weight() if m.share_embeddings_and_output_weights \
            else m.output_layer.weight
        return int(weight.shape[0])

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [n, h] -> logits [n, V_padded] (fp32)."""
        m = self.model
        weight = m.shared_embedding_or_output_weight() if m.share_embeddings_and_output_weights \
            else None
        out, _ = m.output_layer(hidden[:, None], weight=weight)
        return out[:, 0].float()


def generate(args: TrainingConfig, gen: GenerateConfig, model: GPTModel,
             prompts: list[list[int]], eod: int, vocab: int,
             detokenize: Callable[[list[int]], str | None] | None = None) -> list[dict]:
    """Greedy or sampled continuations of `prompts` (ids < vocab), stopping at `eod` or
    after gen.max_new_tokens; every CP rank returns the same records (prompt_ids,
    generated_ids, logprobs: each generated token's log-probability under the model, text)."""
    group = parallel_state.get_context_parallel_group()
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    device = next(model.parameters()).device
    b, longest = len(prompts), max(len(p) for p in prompts)
    lengths = torch.tensor([len(p) for p in prompts], device=device)
    if gen.pack_prompts:
        prompt = Packed.of(prompts, cp, rank, eod, device)
    else:
        prompt = Padded.of(prompts, cp, rank, eod, device)
    layout = CacheLayout(cp, rank, prompt.total, gen.max_new_tokens)
    options = {"schedule": args.mesh_schedule, "backend": getattr(args, "mesh_kernel", "auto")}
    session = InferenceSession(layout, lengths, group, options=options,
                               exchange=gen.decode_exchange, placement=prompt.placement)
    attach(model, session)
    runner = Runner.of(model, max(prompt.total, longest + gen.max_new_tokens),
                       args.max_position_embeddings)
    sampling = Sampling(gen.temperature, gen.top_k, gen.top_p)
    generator = torch.Generator().manual_seed(args.seed)
    timer = _sync_time()
    with torch.inference_mode():
        hidden = runner.hidden(prompt.ids, prompt.positions)
        logits = _last_token_logits(runner, hidden, prompt.last_rows(lengths), group)
        prefill_s = _sync_time() - timer
        made = Continuations(b, eod)
        session.phase = DECODE
        timer, decoded = _sync_time(), 0
        for step in range(gen.max_new_tokens):
            chosen = _agreed(next_tokens(logits[:, :vocab], sampling, generator), device)
            made.add(chosen, _chosen_logprobs(logits[:, :vocab], chosen))
            if made.finished or step == gen.max_new_tokens - 1:
                break
            session.step = step
            hidden = runner.hidden(chosen[:, None].to(device), session.decode_positions()[:, None])
            logits = runner.logits(hidden[0])
            decoded += b
        decode_s = _sync_time() - timer
    attach(model, None)
    _report(model, session, lengths, prefill_s, decoded, decode_s, gen)
    return [{"prompt_ids": p, "generated_ids": g, "logprobs": lp,
             **({"text": detokenize(g)} if detokenize is not None else {})}
            for p, g, lp in zip(prompts, made.ids, made.logprobs)]


def _last_token_logits(runner: Runner, hidden: torch.Tensor,
                       rows: list[tuple[int, int] | None], group: dist.ProcessGroup
                       ) -> torch.Tensor:
    """[b, V] logits of each prompt's last token, from hidden [s, B, h] at (row, column)
    rows[i] on the rank that holds it (None elsewhere); the others add zeros (an exact sum:
    one all-reduce over the CP group)."""
    logits = torch.zeros(len(rows), runner.width, device=hidden.device)
    mine = [i for i, r in enumerate(rows) if r is not None]
    if mine:
        picked = torch.stack([hidden[rows[i][0], rows[i][1]] for i in mine])
        logits[mine] = runner.logits(picked)
    if dist.get_world_size(group) > 1:
        dist.all_reduce(logits, group=group)
    return logits


def _chosen_logprobs(logits: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """[b] the log-probabilities of the chosen tokens [b] under logits [b, V], computed where
    the logits live (only the b values leave the device)."""
    logits = logits.float()
    picked = logits.gather(1, chosen[:, None].to(logits.device))[:, 0]
    return picked - torch.logsumexp(logits, dim=-1)


def _agreed(chosen: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Global rank 0's tokens [b] on every rank (they are equal already; this keeps them so)."""
    chosen = chosen.to(device)
    if dist.get_world_size() > 1:
        dist.broadcast(chosen, src=0)
    return chosen


def _sync_time() -> float:
    if has_cuda():
        torch.cuda.synchronize()
    return time.perf_counter()


def _report(model: GPTModel, session: InferenceSession, lengths: torch.Tensor,
            prefill_s: float, decoded: int, decode_s: float, gen: GenerateConfig) -> None:
    """Rank 0 logs prefill and decode tokens/s and the KV cache bytes per rank, next to what
    one GPU would hold for the same dense batch."""
    prompt_tokens = int(lengths.sum())
    held = session.cache_bytes()
    cfg = model.config
    shape = AttentionShape(int(lengths.max()), session.batch, cfg.num_attention_heads,
                           cfg.num_query_groups or cfg.num_attention_heads, cfg.kv_channels,
                           next(model.parameters()).element_size())
    one = cache_bytes(shape, cfg.num_layers, gen.max_new_tokens, 1)
    print_rank0(f" prefill: {prompt_tokens} prompt tokens ({session.batch} prompts) in "
                f"{prefill_s:.3f} s, {prompt_tokens / max(prefill_s, 1e-9):.1f} tokens/s | "
                f"decode: {decoded} tokens in {decode_s:.3f} s, "
                f"{decoded / max(decode_s, 1e-9):.1f} tokens/s")
    shard = next(iter(session.shards.values()))
    slots = (f"{shard.k.shape[0]} slots of packed documents" if session.placement is not None
             else f"{shard.k.shape[0]} slots x {session.batch} sequences")
    print_rank0(f" KV cache per rank: {held} bytes ({slots} x {len(session.shards)} layers; "
                f"CP = 1 would hold {one} bytes)")


def continuation_lines(records: list[dict], detokenize: Callable[[list[int]], str | None] | None
                       ) -> list[str]:
    """'PROMPT -> CONTINUATION', one a prompt: their text where the tokenizer has one, else
    their ids separated by spaces (what the command prints without --output)."""
    def shown(ids: list[int]) -> str:
        text = None if detokenize is None else detokenize(ids)
        return " ".join(map(str, ids)) if text is None else text

    return [f"{shown(r['prompt_ids'])} -> {shown(r['generated_ids'])}" for r in records]


def write_output(path: str | None, records: list[dict]) -> None:
    """JSON lines, one record per prompt (rank 0 writes; nothing without a path)."""
    if path is None or dist.get_rank() != 0:
        return
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
