"""Runtime policies of one training step: what techniques change without touching the model.

The training loop calls `forward`, `backward` and `step` as three measured phases; with
gradient accumulation (`micro_batches` = k > 1) forward and backward run once per micro-batch
and `step` once per optimizer step. Techniques add to the runtime: contexts entered around
the forward (autocast), transforms of tensors saved for backward (offload), a gradient scaler,
an optimizer factory (ZeRO), hooks after each micro-batch's backward (adaptive accumulation),
before the optimizer step (gradient clipping) and after each step (controllers), and the
current batch size and micro-batch count.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager

import torch
from torch import nn

PackHook = Callable[[Any], Any]  # a tensor, or what an earlier transform packed it into
UnpackHook = Callable[[Any], Any]

BOUNDARY = "_memstudy_boundary"  # attribute set on tensors kept between regions
ROWS = "_memstudy_rows"  # ... that backward reads strip by strip (tile region inputs)


@dataclass(frozen=True)
class SavedTensorTransform:
    owner: str  # the technique's name; its place in the chain is its composition order
    pack: PackHook
    unpack: UnpackHook


def saved_tensors_of(packed: Any) -> list[torch.Tensor]:
    """The tensors a packed saved tensor holds: itself, or a packed object's `tensors()`.

    A transform that packs into something other than a tensor (compress: codes and per-group
    statistics) gives it `tensors()` (what the meters count) and `map_tensors(fn)` (a copy
    with every tensor replaced by fn(tensor): how offload moves it)."""
    if isinstance(packed, torch.Tensor):
        return [packed]
    tensors = getattr(packed, "tensors", None)
    return list(tensors()) if tensors is not None else []


def mark_boundary(*tensors: Any, rows: bool = False) -> None:
    """Mark tensors kept between regions - checkpoint region inputs, tile boundaries - so that
    transforms restricted to boundaries (compress / offload `which=boundaries`) act on them;
    `rows`: their backward reads them strip by strip, top to bottom, waiting for each strip's
    rows (tile sweeps: `RowArrivals`), and they are marked as their region starts, which the
    watchers of `watching_boundaries` are told. Marking changes nothing else; non-tensors and
    parameters are ignored."""
    for t in tensors:
        if isinstance(t, torch.Tensor) and not isinstance(t, nn.Parameter):
            setattr(t, BOUNDARY, True)
            if rows:
                setattr(t, ROWS, True)
                for watch in _ROW_BOUNDARY_WATCHERS:
                    watch(t)


_ROW_BOUNDARY_WATCHERS: list[Callable[[torch.Tensor], None]] = []


@contextlib.contextmanager
def watching_boundaries(watch: Callable[[torch.Tensor], None]):
    """Within: `watch(t)` is called for each boundary marked with `rows` (a tile region's
    input, as the region starts, before its sweeps save it): offload's early copies."""
    _ROW_BOUNDARY_WATCHERS.append(watch)
    try:
        yield
    finally:
        _ROW_BOUNDARY_WATCHERS.remove(watch)


def is_boundary(obj: Any) -> bool:
    return bool(getattr(obj, BOUNDARY, False))


def read_by_rows(obj: Any) -> bool:
    return bool(getattr(obj, ROWS, False))


class Nesting:
    """How many of some context are open now (they may nest): `entered()` opens one."""

    def __init__(self):
        self.depth = 0

    @contextlib.contextmanager
    def entered(self):
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1

    @property
    def active(self) -> bool:
        return self.depth > 0


class RowArrivals:
    """Tensors handed out while their rows are still arriving, and the readers that wait.

    A tile sweep's backward reads its inputs strip by strip, top to bottom, so the rows below
    the strip it works on can still be on their way: offload brings such a boundary back from
    the host in row chunks on a side stream (`arriving`: an object whose `wait(lo, hi)` makes
    the current stream wait for those rows' chunks, `all_waited` says whether any are left and
    `done()` whether all have landed), and the sweep waits for each strip's rows before it
    reads them (`await_rows`). Only an unpack inside `by_rows()` (the sweeps' backward) may take
    a tensor whose rows are still arriving; every other unpack waits for all of its rows
    (offload's `await_rows` over the whole height), since autograd's own nodes read whole
    tensors. Entries are keyed by the storage's address: autograd may hand the unpacking
    Function a new tensor object sharing the unpacked one's storage. One per process (`ROWS_IN`),
    shared by the offloader and the sweeps as `mark_boundary` marks are."""

    def __init__(self):
        self.readers = Nesting()  # unpacks by row readers running now (`by_rows`)
        self._pending: dict[int, Any] = {}

    def by_rows(self) -> contextlib.AbstractContextManager:
        return self.readers.entered()

    @property
    def wanted(self) -> bool:
        """The unpack happening now is a row reader's (inside `by_rows`)."""
        return self.readers.active

    def arriving(self, t: torch.Tensor, rows: Any) -> None:
        # entries whose copies have all landed need no wait any more (rows.done: a query)
        for key in [k for k, pending in self._pending.items() if pending.done()]:
            del self._pending[key]
        self._pending[t.untyped_storage().data_ptr()] = rows

    def await_rows(self, t: torch.Tensor, lo: int, hi: int) -> None:
        """Make the current stream wait until rows lo:hi (dim -2) of `t` have arrived."""
        if self._pending:
            key = t.untyped_storage().data_ptr()
            rows = self._pending.get(key)
            if rows is not None:
                rows.wait(lo, hi)
                if rows.all_waited:  # nothing left to wait for: later strips skip the lookup
                    del self._pending[key]


ROWS_IN = RowArrivals()


class CheckpointRegions(Nesting):
    """The checkpoint regions running now (their forward, or their recomputation), counted by
    `checkpoint` and read by ops that spend extra work to save less (compress's ReLU sign
    masks): inside a region what they save is discarded in forward and lives only during the
    region's own backward when recomputed, so they skip the work. One per run (the Runtime's)."""

    def running(self) -> contextlib.AbstractContextManager:
        return self.entered()


@dataclass
class StepInfo:
    step: int  # optimizer steps taken so far, this one included
    epoch: int
    loss: float
    batch_size: int  # images of the step on this rank (all micro-batches together)
    optimizer: torch.optim.Optimizer
    micro_batches: int = 1  # forward + backward passes accumulated into this step


@dataclass
class MicroBatch:
    """One forward + backward of an optimizer step (gradient accumulation, [Compute-Opt] eq. 4,
    docs/references.md)."""
    step: int  # the optimizer step it belongs to (1-based: the step being taken)
    index: int  # 0 .. count - 1
    count: int  # micro-batches of this step (the last step of an epoch may have fewer than k)
    images: int  # images of this micro-batch on this rank
    weight: float  # its loss's factor: images / images of the step (1/k for equal micro-batches)


@dataclass
class Runtime:
    device: torch.device
    batch_size: int
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    optimizer_factory: Callable[[nn.Module], torch.optim.Optimizer]
    forward_contexts: list[Callable[[], ContextManager]] = field(default_factory=list)
    # Entered (after autocast is turned off) for a float32 evaluation forward: techniques that
    # set precision themselves, past autocast, put it back to float32 here (tri_accel's units).
    float32_contexts: list[Callable[[], ContextManager]] = field(default_factory=list)
    # Each technique's place in the plan's composition order (compose.build_pipeline sets it):
    # where a technique's saved-tensor transform goes in the chain.
    transform_order: dict[str, int] = field(default_factory=dict)
    # The chain of saved-tensor transforms (compress, offload), in composition order.
    saved_tensor_transforms: list[SavedTensorTransform] = field(default_factory=list)
    saved_tensor_observers: list[Callable[[Any], None]] = field(default_factory=list)
    # Told when the run's MSSSIMLoss starts / ends and when its input's gradient is ready (the
    # loss notifies this list: compose.build_pipeline gives it to both).
    loss_observers: list[Any] = field(default_factory=list)
    checkpoint_regions: CheckpointRegions = field(default_factory=CheckpointRegions)
    scaler: Any = None  # torch.amp.GradScaler when float16 is in use
    step_hooks: list[Callable[[StepInfo], None]] = field(default_factory=list)
    # Called with the OutOfMemoryError of a failed training step; True means "handled, retry
    # the step" (the elastic batch controller shrinks the batch). None: OOM ends the run.
    oom_handler: Callable[[BaseException], bool] | None = None
    input_device: torch.device | None = None  # where batches go (model parallel: first stage)
    output_device: torch.device | None = None  # where targets go (model parallel: last stage)
    # tile:stream: batches stay in pinned host memory; the tiled regions bring in the image's
    # strips they read and the chunked loss the target's blocks
    inputs_on_host: bool = False
    # The tensor meter enforcing a CPU budget (set by the runner), for controllers that steer
    # by memory use (tri_accel's elastic batch); None on a GPU or without a budget.
    memory_meter: Any = None
    # Extra per-step rows (rank, step, name, value) a technique records; the runner stores them
    # in `series` with the loop's own rows. Names must not repeat within a step.
    series_sources: list[Callable[[], list[tuple[int, int, str, float]]]] = field(default_factory=list)
    rank: int = 0  # process rank that produced the records (distributed runs)
    # (index, count): this process draws shard `index` of each global batch of batch_size *
    # count images (data parallel); (0, 1) draws the whole batch.
    shard: tuple[int, int] = (0, 1)
    # Replaces forward + backward of a step (pipeline schedules fuse them): (model, x, y) ->
    # detached loss; recorded as one phase, "forward_backward".
    forward_backward: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    # Gradient accumulation: micro-batches of `batch_size` images per optimizer step (k). A hook
    # may change it between steps (adaptive accumulation); the loop draws k * batch_size images.
    micro_batches: int = 1
    # Called inside each micro-batch's backward phase, after the backward (adaptive k's statistics).
    micro_batch_hooks: list[Callable[[MicroBatch], None]] = field(default_factory=list)
    # Called by `step` before the optimizer step, gradients complete (gradient clipping).
    pre_step_hooks: list[Callable[[torch.optim.Optimizer], None]] = field(default_factory=list)

    def add_saved_tensor_transform(self, pack: PackHook, unpack: UnpackHook, owner: str) -> None:
        """Add the technique `owner`'s transform to the chain. Its place is the technique's
        place in the plan's composition order (`transform_order`, set by compose from the plan),
        whatever order transforms are added in: pack runs in that order, unpack in reverse.
        compress comes before offload, so offload moves the compressed bytes and brings them
        back before they are decompressed."""
        if owner not in self.transform_order:
            raise RuntimeError(f"{owner}: not in the runtime's transform_order (the plan's "
                               "composition order, which compose.build_pipeline sets)")
        if any(t.owner == owner for t in self.saved_tensor_transforms):
            raise RuntimeError(f"{owner}: already transforms saved tensors")
        self.saved_tensor_transforms.append(SavedTensorTransform(owner, pack, unpack))
        self.saved_tensor_transforms.sort(key=lambda t: self.transform_order[t.owner])

    def forward_context(self) -> contextlib.ExitStack:
        stack = contextlib.ExitStack()
        for make in self.forward_contexts:
            stack.enter_context(make())
        hooks = self._saved_tensor_hooks()
        if hooks is not None:
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(*hooks))
        return stack

    def _saved_tensor_hooks(self) -> tuple[PackHook, UnpackHook] | None:
        transforms, observers = self.saved_tensor_transforms, self.saved_tensor_observers
        if not transforms and not observers:
            return None  # no hooks at all: nothing added to the measured hot path
        packs = [t.pack for t in transforms]
        unpacks = [t.unpack for t in reversed(transforms)]

        def observed_pack(tensor: torch.Tensor) -> Any:
            packed = tensor
            for pack in packs:
                packed = pack(packed)
            if packed is tensor:
                # Keep a detached alias, never the tensor itself: a saved *output* still holds
                # its grad_fn, which owns this SavedVariable, so storing it forms a cycle through
                # C++ that gc.collect() cannot break. backward() releases it, but a step that
                # fails before backward (an OOM) would keep its whole forward alive. autograd
                # re-attaches the grad_fn on unpack (what it does itself for saved outputs).
                packed = tensor.detach()
            for observe in observers:
                for saved in saved_tensors_of(packed):
                    observe(saved)
            return packed

        def chained_unpack(packed: Any) -> torch.Tensor:
            for unpack in unpacks:
                packed = unpack(packed)
            return packed

        return observed_pack, chained_unpack

    def forward(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with self.forward_context():
            out = model(x)
            return self.loss_fn(out, y if self.inputs_on_host else
                                y.to(out.device, non_blocking=True))

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        for hook in self.pre_step_hooks:
            hook(optimizer)
        if self.scaler is not None:
            self.scaler.step(optimizer)
            self.scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
