"""Our driver against Hugging Face transformers' GPT-2 of the same size, in one run.

Both train the same layers, width, heads, sequence and micro-batch on mock tokens with AdamW:
our driver (`megatron_mesh.pretrain_gpt`, CP = 1, its default attention: Transformer Engine
when installed, else the mesh's fused tile kernel) through torchrun, then GPT2LMHeadModel with
SDPA attention (bf16 autocast and fused AdamW on a GPU) in this process. Prints tokens/s
(median over the steps after --warmup) and peak memory side by side; --json writes them.

    python scripts/compare_hf_gpt2.py                      # GPT-3 125M shape, S=4096, b=4, GPU
    python scripts/compare_hf_gpt2.py --layers 2 --hidden 64 --heads 4 --seq 64 --batch 2 \\
        --iters 4 --warmup 1                               # tiny, on a CPU (labelled CPU run)
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
# the driver's log line (training/logs/metrics.py): "... tokens/s: T | ... | peak memory GPU (MiB): M |"
LINE = re.compile(r"iteration\s+(\d+)/.*?tokens/s: ([0-9.]+).*?peak memory (?:GPU|RSS) \(MiB\): "
                  r"([0-9.]+)")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--batch", type=int, default=4, help="micro-batch = global batch (one rank)")
    p.add_argument("--vocab", type=int, default=50257, help="vocabulary (GPT-2's by default)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5, help="steps left out of the median")
    p.add_argument("--json", default=None, help="write the results to this file")
    args = p.parse_args(argv)
    if args.warmup >= args.iters:
        p.error(f"--warmup {args.warmup} must be smaller than --iters {args.iters}")
    if args.hidden % args.heads:
        p.error(f"--hidden {args.hidden} must be a multiple of --heads {args.heads}")
    return args


def ours(args: argparse.Namespace, cuda: bool) -> dict:
    """Our driver through torchrun (one rank): median tokens/s and its last peak memory."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
           "-m", "megatron_mesh.pretrain_gpt", "--num-layers", str(args.layers),
           "--hidden-size", str(args.hidden), "--num-attention-heads", str(args.heads),
           "--seq-length", str(args.seq), "--max-position-embeddings", str(args.seq),
           "--micro-batch-size", str(args.batch), "--global-batch-size", str(args.batch),
           "--train-iters", str(args.iters), "--lr", "1e-4", "--log-interval", "1",
           "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(args.vocab),
           "--hidden-dropout", "0", "--attention-dropout", "0", *(["--bf16"] if cuda else [])]
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               WANDB_MODE="disabled")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    out = proc.stdout + proc.stderr
    steps = [(int(m[1]), float(m[2]), float(m[3])) for m in LINE.finditer(out)]
    if proc.returncode != 0:
        raise RuntimeError(f"the driver failed (exit {proc.returncode}):\n{out[-3000:]}")
    if len(steps) != args.iters:
        raise RuntimeError(f"the driver ran (exit 0) but {len(steps)} of its {args.iters} log lines "
                           f"parse as {LINE.pattern!r}:\n{out[-3000:]}")
    attention = re.search(r"\| attention ([^|]+) \|", out)
    return {"tokens_per_s": statistics.median(t for i, t, _ in steps if i > args.warmup),
            "peak_memory_mib": steps[-1][2],
            "attention": attention[1].strip() if attention else "?"}


def hugging_face(args: argparse.Namespace, device: torch.device) -> dict:
    """GPT2LMHeadModel, SDPA attention, AdamW; bf16 autocast on a GPU."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=args.vocab, n_positions=args.seq, n_embd=args.hidden,
                        n_layer=args.layers, n_head=args.heads, resid_pdrop=0.0, embd_pdrop=0.0,
                        attn_pdrop=0.0, attn_implementation="sdpa")
    model = GPT2LMHeadModel(config).to(device)
    if model.config._attn_implementation != "sdpa":
        raise RuntimeError(f"GPT-2 attention is {model.config._attn_implementation}, not sdpa")
    model.train()
    cuda = device.type == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cuda)
    gen = torch.Generator(device="cpu").manual_seed(0)
    tokens = torch.randint(0, args.vocab, (args.iters, args.batch, args.seq), generator=gen)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    rates = []
    for step in range(args.iters):
        batch = tokens[step].to(device)
        t0 = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize(device)
        if step >= args.warmup:
            rates.append(args.batch * args.seq / (time.perf_counter() - t0))
    if cuda:
        peak = torch.cuda.max_memory_allocated(device)
    else:
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"tokens_per_s": statistics.median(rates), "peak_memory_mib": peak / 2**20,
            "attention": "sdpa"}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    where = (f"GPU run on {torch.cuda.get_device_name(device)}, bf16" if cuda
             else "CPU run (fp32; not a GPU measurement; peak memory is the process's RSS)")
    try:
        import transformers
    except ImportError:
        print("transformers is not installed: pip install transformers (it needs no other "
              "torch); our driver alone is not compared", file=sys.stderr)
        sys.exit(2)
    rows = {"megatron-mesh driver": ours(args, cuda), f"transformers {transformers.__version__} "
            "GPT-2": hugging_face(args, device)}
    print(f"GPT-2-shaped model: {args.layers} layers, hidden {args.hidden}, heads {args.heads}, "
          f"seq {args.seq}, micro-batch {args.batch}, {args.iters} steps (median after "
          f"{args.warmup}); {where}")
    print(f"{'':>32} {'tokens/s':>12} {'peak MiB':>10}  attention")
    for name, row in rows.items():
        print(f"{name:>32} {row['tokens_per_s']:12.1f} {row['peak_memory_mib']:10.1f}  "
              f"{row['attention']}")
    if args.json:
        Path(args.json).write_text(json.dumps({"device": "cuda" if cuda else "cpu",
                                               "config": vars(args), "results": rows}, indent=1))


if __name__ == "__main__":
    main()
