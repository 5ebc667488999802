"""The training loop: steps, evaluation, optimizer and LR schedule, stopping."""
