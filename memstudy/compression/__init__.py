"""Activation compression, the machinery of the `compress` technique
(memstudy/techniques/compress.py, which explains the memory / accuracy trade-off):

- `codec`: saved tensors to codes + per-group statistics and back (the runtime's pack /
  unpack pair), over the kernels of memstudy/kernels/quantize.py;
- `patches`: ReLU and max-pool forwards that save a 1-bit sign mask / 4-bit window offsets
  instead of their output / int64 indices (exact backward);
- `probe`: per-step saved bytes, and the gradient's deviation from an uncompressed re-run.
"""
