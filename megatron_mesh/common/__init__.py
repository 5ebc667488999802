"""What the masks, the kernels and the runtime share, and nothing of the package's layers:
the mask a kernel call takes (`tile_slices.py`: made by masks/, read by kernels/), the
log-sum-exp merge (`merge.py`) and the
bounded caches of block data (`caches.py`). masks/, kernels/ and runtime/ import each other
only through here."""
