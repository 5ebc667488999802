"""What runs between ranks: the collectives and their observers (`comm`), the grid's
process groups, the heads all-to-all, the per-call agreement, the gloo spawn harness and
the peak-memory probe.
"""
