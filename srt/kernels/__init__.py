"""Compiled CPU kernels: the C sources in `csrc/`, built and cached by `build`, and one thin
ctypes wrapper per kernel family (`attention`, `linear`, `layer_ops`, `decode_layer`).

Each family's loader (`paged_decode_kernel()`, `packed_linear_kernel()`, ...) builds its
library at first call and returns None where it cannot; callers then keep their torch path.
"""
