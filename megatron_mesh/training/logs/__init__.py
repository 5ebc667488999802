"""What a run reports: the log line, wandb and TensorBoard."""
