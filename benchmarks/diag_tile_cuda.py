"""Diagnosis: tiled vs untiled gradients on CUDA (float32, TF32 off) with each CUDA primitive of
memstudy/tiling/norm.py on or off, and with inputs forced contiguous; prints the worst tensors."""
import sys
import torch
sys.path.insert(0, ".")
from memstudy.models import build_unet
from memstudy.tiling import norm
from memstudy.tiling.unet import TiledForward

torch.backends.cudnn.allow_tf32 = False
x = torch.rand(1, 1, 512, 512, device="cuda").to(memory_format=torch.channels_last)


def grads(tiles, cl=True):
    model = build_unet(seed=0).cuda()
    if cl:
        model = model.to(memory_format=torch.channels_last)
    if tiles:
        model.forward_padded = TiledForward(model, 2, tiles=tiles)
    model(x).square().mean().backward()
    return {n: p.grad.double().cpu() for n, p in model.named_parameters()}


def report(label, got, ref):
    errs = {n: ((got[n] - ref[n]).norm() / ref[n].norm().clamp_min(1e-30)).item() for n in ref}
    worst = sorted(errs, key=errs.get)[-4:]
    print(label, " | ".join(f"{n}: {errs[n]:.2e}" for n in worst), flush=True)


ref = grads(0)
for n_on in (True, False):
    for m_on in (True, False):
        norm.CUDA_PRIMITIVES.update(norm=n_on, moments=m_on)
        report(f"norm={n_on} moments={m_on}", grads(4), ref)
norm.CUDA_PRIMITIVES.update(norm=True, moments=True)
report("contiguous-format model", grads(4, cl=False), grads(0, cl=False))
