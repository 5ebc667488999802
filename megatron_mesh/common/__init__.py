"""What the masks, the kernels and the runtime share, and nothing of the package's layers:
the masks a tile call takes (`tile_mask.py`: made by masks/, read by kernels/) and the
bounded caches of block data (`caches.py`). masks/, kernels/ and runtime/ import each other
only through here."""
