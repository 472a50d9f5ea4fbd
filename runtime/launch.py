"""What every launcher shares: a prepared launch (its packed parameters, replayed with pointer slots
re-filled), grid helpers and the grid cap the tests use."""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

from .arrays import ArrayRef
from .device import driver


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def ptr(a) -> int:
    return a.ptr if isinstance(a, ArrayRef) else 0


MAX_GRID_X = 2**31 - 1
MAX_GRID_Y = 65535
# Verification hook: when set, elementwise grids are capped at this many blocks, so that small
# test shapes exercise the kernels' grid-stride loops (codegen/harness/checks/ sets it with grid_cap()).
GRID_CAP = [None]


@contextmanager
def grid_cap(blocks: int):
    """Cap elementwise grids at ``blocks`` inside the block (prepared replayed launches are
    forgotten on entry and exit, so none crosses the boundary)."""
    from .replay import CACHE
    CACHE.clear()
    GRID_CAP[0] = blocks
    try:
        yield
    finally:
        GRID_CAP[0] = None
        CACHE.clear()


def row_grid(rows: int, ty: int) -> int:
    """Blocks for a grid-stride loop over rows: one block per ``ty`` rows (no tail imbalance
    from a capped grid), capped at the grid limit; the kernel's loop covers the rest."""
    return max(1, min(-(-rows // ty), MAX_GRID_X))


@dataclass
class PreparedLaunch:
    """A launch with its parameters packed in order (``abi``: their names and slots), replayed by
    the replay of repeated calls with its pointer slots re-filled."""
    fn: object
    grid: tuple
    block: tuple
    abi: object            # runtime.abi.Abi
    values: list
    shared_mem: int = 0
    go: object = field(default=None, repr=False, compare=False)   # the driver's bound launch, made on first use

    @property
    def fmt(self) -> str:
        return self.abi.fmt

    def bound(self):
        """``go(stream, values)``: this launch with everything but the stream and the parameter
        values resolved (:meth:`runtime.device.Driver.bind_launch` of the current driver)."""
        go = self.go
        if go is None:
            go = self.go = driver().bind_launch(self.fn, self.grid, self.block, self.abi.fmt, self.shared_mem)
        return go

    def launch(self, stream: int, values=None) -> None:
        (self.go or self.bound())(stream, self.values if values is None else values)
