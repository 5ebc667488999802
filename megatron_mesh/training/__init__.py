"""Pretraining driver on megatron-core, in rooms by what changes together:

    config/       the flags (the parser, its checks) and the typed config they make
    job/          the job's process: devices, process groups, host-staged CP, the console
    data/         tokenizer, datasets, documents over the CP ranks, micro-batches, the
                  dataset tool
    model/        the GPT model on megatron-core: config, layer spec, MoE, pipeline, FLOPs
    loop/         steps, evaluation, optimizer and LR schedule, stopping
    checkpoints/  save and load, checksums, the model description, resume
    logs/         the log line, wandb, TensorBoard
    run.py        a training job assembled from them

Generation (inference/megatron/) reads config/, job/, model/ and checkpoints/ of these.
``python -m megatron_mesh.pretrain_gpt --help`` lists the flags; docs/training.md explains them.
"""
