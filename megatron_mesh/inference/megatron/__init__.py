"""Generation on megatron-core: the part of inference that imports megatron (and the
pretraining driver's flags, model and checkpoints); the algorithm it runs is the folder
above, which never does.

    command.py          `python -m megatron_mesh.generate`: every check, then the job
    arguments.py        the command's own flags, its prompts, the checks before any collective
    checkpoint.py       the checkpoint's model description and weights, checked, then loaded
    generation.py       the driver's GPTModel run layer by layer: prefill, decode steps, output
    cached_attention.py the core-attention slot holding the rank's KV-cache shard

docs/inference.md describes the design.
"""
