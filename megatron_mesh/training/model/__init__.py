"""The GPT model on megatron-core: config, layer spec, MoE, pipeline stages, FLOPs."""
