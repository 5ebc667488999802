"""Pretraining driver on megatron-core: arguments, setup, model, data, loop, checkpoints.

``python -m megatron_mesh.pretrain_gpt --help`` lists the flags; docs/training.md explains them.
"""
