"""Exact spatial tiling of the U-Net's top levels (training with exact BatchNorm, and inference).

- `geometry`: row geometry, halos and tile plans.
- `sweep`: the tile-by-tile Functions (whole-image BatchNorm statistics as differentiable
  tensors, tile recomputation in backward) for any region written as a tile body.
- `levels`: which levels are tiled and their halos (pure Python, for the config checks).
- `unet`: the smp U-Net / ResNet-34 regions and `TiledForward`, which replaces a model's
  `forward_padded`.
- `validation`: the exact tiled validation forward (`train.val_tile_rows`).
See docs/techniques/tile.md.
"""
