"""What a layer's queries see: where the tokens are (the zigzag rule, packed
documents in Transformer Engine's THD layout, placed documents), sliding windows and
sinks, and the blocks each mask kind makes (`block.Block`, the one value schedules take).
"""
