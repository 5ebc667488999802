"""Kernel calls: a mask laid on the grid's ranks as blocks (`layout.block_for`), and the
blocks grouped into the calls a kernel takes (`groups`), each with its slices
(`tile_slices.TileSlices`) and runs (`tile_runs`). Between the masks and the kernels."""
