"""Byte and memory models of a layer's plan, and the plan itself (`plan.resolve_plan`):
no torch.distributed, no tensors.
"""
