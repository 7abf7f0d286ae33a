"""Exact spatial tiling of the U-Net's top levels (training with exact BatchNorm, and inference).

- `geometry`: row geometry, halos and tile plans.
- `sweep`: the tile-by-tile Functions (whole-image BatchNorm statistics as differentiable
  tensors, tile recomputation in backward) for any region written as a tile body.
- `levels`: which levels are tiled and their halos (pure Python, for the config checks).
- `chain`: the regions of the smp U-Net (any ResNet-family encoder) written once, for the
  tile bodies and for their halos.
- `tiled_forward`: the tile bodies and `TiledForward`, which replaces a model's
  `forward_padded`.
- `norm`: the tiled BatchNorm (statistics, normalisation) and `norm_act`: its Triton kernels
  beside that PyTorch reference.
- `graphs`: tile bodies replayed as CUDA graphs.
- `validation`: the exact tiled validation forward (`train.val_tile_rows`).
See docs/techniques/tile.md.
"""
