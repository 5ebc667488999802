"""How a rank computes its tile: the gathered code, the two rings, the sparse exchange,
and their shared parts (one block's kernel calls, the log-sum-exp merge, D).
"""
