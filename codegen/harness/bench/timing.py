"""Device time of zero-argument calls: the CUDA-event :class:`Timer` (behind a spin kernel, after a
warm-up, contenders in turns), the device-to-device copy every result is compared with, the number of
L2-rotated input sets, and the arithmetic of the figures (GB/s, TFLOP/s, %, geometric mean, medians).
The method: docs/audit.md, "python -m codegen bench"."""
from __future__ import annotations

import math
import statistics
import sys
import time
from typing import Optional

MAX_SETS = 256
WARMUP_MS = 30.0        # device time of back-to-back calls before timing: the clocks ramp back after
                        # idle stretches (a torch.compile of the previous workload takes seconds)
TURN_MS = 10.0          # device time of one contender's batch when several are timed in turns
MAX_SPIN_NS = 5e7       # the longest spin a batch is queued behind (a longer batch is cut)
MAX_DROPPED = 8         # batches dropped per contender before its samples are taken as they come
COPY_BYTES = 1 << 30

SPIN_SRC = r"""
extern "C" __global__ void sf_bench_spin(unsigned long long ns) {
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < ns);
}
"""


# -- the arithmetic (unit-tested on the CPU) ------------------------------------------------------
def gbps(nbytes_: int, ms: float) -> float:
    return nbytes_ / (ms * 1e-3) / 1e9


def tflops(flops: float, ms: float) -> float:
    return flops / (ms * 1e-3) / 1e12


def pct(value: float, ref: float) -> float:
    return 100.0 * value / ref


def geomean(values) -> Optional[float]:
    vals = [v for v in values if v is not None and v > 0]
    return math.exp(sum(math.log(v) for v in vals) / len(vals)) if vals else None


def rotation_sets(footprint: int, l2_bytes: int, cap: int = MAX_SETS) -> int:
    """Input sets to rotate so that the working set is at least 4x the L2 cache."""
    if footprint <= 0:
        return 1
    return max(1, min(cap, math.ceil(4 * l2_bytes / footprint)))


def stats(times_ms) -> dict:
    t = sorted(times_ms)
    q = lambda f: t[min(len(t) - 1, int(f * len(t)))]  # noqa: E731
    return {"ms": statistics.median(t), "p10_ms": q(0.1), "p90_ms": q(0.9), "samples": len(t)}


class Timer:
    """CUDA-event timing of zero-arg callables, queued behind a spin kernel (GPU time, not host time),
    after WARMUP_MS of back-to-back calls (without it, results timed after an idle stretch, such as
    the torch.compile of the previous workload, came out 10-20 points low on 50 µs kernels)."""

    def __init__(self, stream, samples: int, max_seconds: float):
        import cupy as cp
        self.cp, self.stream, self.samples, self.max_seconds = cp, stream, samples, max_seconds
        self.spin = cp.RawKernel(SPIN_SRC, "sf_bench_spin")

    def spin_ns(self, ns: int):
        import numpy as np
        self.spin((1,), (1,), (np.uint64(max(0, int(ns))),), stream=self.stream)

    def measure(self, calls) -> dict:
        return self.measure_turns([calls])[0]

    def _warm(self, calls) -> tuple:
        """First calls (loads, compiles, allocator), then WARMUP_MS of back-to-back calls:
        (seconds of the first calls, host seconds per call, device ms per call)."""
        cp, st = self.cp, self.stream
        n = len(calls)
        t0 = time.perf_counter()
        for c in calls:              # every set once: loads, compiles, allocator warm-up
            c()
        for i in range(3):
            calls[i % n]()
        st.synchronize()
        first_s = time.perf_counter() - t0
        e0, e1 = cp.cuda.Event(), cp.cuda.Event()
        e0.record(st)
        for i in range(4):
            calls[i % n]()
        e1.record(st)
        e1.synchronize()
        per_ms = max(cp.cuda.get_elapsed_time(e0, e1) / 4, 1e-3)
        for i in range(min(20000, int(WARMUP_MS / per_ms) + 1)):   # WARMUP_MS of device time
            calls[i % n]()
        st.synchronize()
        t0 = time.perf_counter()     # host enqueue time per call (the queue does not fill in 8 calls)
        for i in range(8):
            calls[i % n]()
        host_s = (time.perf_counter() - t0) / 8
        st.synchronize()
        return first_s, host_s, per_ms

    def measure_turns(self, contenders) -> list:
        """One stats dict per contender (a list of zero-arg calls each, cycled over), the contenders
        timed in turns: a batch of one (at most TURN_MS of device time), then one of the next, ...
        until each has ``samples``. A ratio between contenders (skuforge against its PyTorch
        reference) is then taken at one clock and temperature of the GPU, not at two moments of a run
        whose clocks drift by a few percent."""
        cp, st = self.cp, self.stream
        warm = [self._warm(calls) for calls in contenders]
        turn = len(contenders) > 1          # one contender: batches as long as the enqueue allows
        batch = [max(1, min(self.samples, int(0.02 / max(host_s, 1e-6)),
                            int(TURN_MS / per_ms) + 1 if turn else self.samples))
                 for _, host_s, per_ms in warm]
        events = [[(cp.cuda.Event(), cp.cuda.Event()) for _ in range(b)] for b in batch]
        times = [[] for _ in contenders]
        done = [0] * len(contenders)
        start = time.perf_counter()
        # A batch counts only if the GPU was still in the spin when its last call was enqueued:
        # otherwise the GPU may have waited for the host between two calls, and an event pair would
        # time the host's call path, not the kernel. Such a batch is dropped and that contender's
        # spin doubled (its calls took the host longer than the warm-up's estimate).
        spin = [1.5] * len(contenders)
        dropped = [0] * len(contenders)
        in_spin = [cp.cuda.Event(disable_timing=True) for _ in contenders]   # recorded behind each spin
        while any(len(t) < self.samples for t in times):
            for k, calls in enumerate(contenders):
                b = min(batch[k], self.samples - len(times[k]))
                if b <= 0:
                    continue
                host_s = warm[k][1]
                b = max(1, min(b, int(MAX_SPIN_NS / max(host_s * spin[k] * 1e9, 1.0))))
                self.spin_ns(min(MAX_SPIN_NS, b * host_s * spin[k] * 1e9 + 2e4))  # the GPU busy while we enqueue
                in_spin[k].record(st)
                for j in range(b):
                    e0, e1 = events[k][j]
                    e0.record(st)
                    calls[done[k] % len(calls)]()
                    e1.record(st)
                    done[k] += 1
                drained = in_spin[k].done       # the spin ended before the batch was enqueued
                events[k][b - 1][1].synchronize()
                if drained and dropped[k] < MAX_DROPPED:
                    dropped[k] += 1
                    spin[k] *= 2
                    continue
                times[k] += [cp.cuda.get_elapsed_time(e0, e1) for e0, e1 in events[k][:b]]
            if time.perf_counter() - start > self.max_seconds and all(len(t) >= 10 for t in times):
                break
        out = []
        for (first_s, host_s, _), t, d in zip(warm, times, dropped):
            r = stats(t)
            r["first_call_s"] = round(first_s, 3)
            r["host_us"] = round(host_s * 1e6, 2)
            if d:
                r["dropped_batches"] = d
            out.append(r)
        return out


def copy_bandwidth(timer: "Timer", nbytes_: int = COPY_BYTES, sets: int = 1) -> dict:
    """cudaMemcpyAsync device to device of ``nbytes_`` (random bytes): GB/s counting read + write.
    ``sets`` (source, destination) pairs are copied in turn, as the kernels' input sets rotate, so that
    a copy smaller than the L2 cache is not read from it."""
    cp = timer.cp
    src = cp.random.randint(1, 255, size=nbytes_, dtype=cp.uint8)
    bufs = [(src if i == 0 else src.copy(), cp.empty_like(src)) for i in range(sets)]
    calls = [lambda s=s_, d=d_: d.data.copy_from_device_async(s.data, nbytes_, timer.stream) for s_, d_ in bufs]
    m = timer.measure(calls)
    del src, bufs, calls
    cp.get_default_memory_pool().free_all_blocks()
    return {"bytes": nbytes_, "ms": m["ms"], "gbps": gbps(2 * nbytes_, m["ms"]), "samples": m["samples"],
            "sets": sets, "method": "cudaMemcpyAsync device-to-device; bytes = read + written"
                                    + (f"; {sets} buffer pairs in turn (L2-rotated)" if sets > 1 else "")}


_SAME_COPY: dict = {}


def same_size_copy(timer, nbytes_: int, l2_bytes: int) -> dict:
    """A device copy moving ``nbytes_`` in total (half read, half written), its buffers rotated over
    as many pairs as make 4x the L2 cache (as the kernels' input sets are); measured once per size."""
    if nbytes_ not in _SAME_COPY:
        _SAME_COPY[nbytes_] = copy_bandwidth(timer, max(1, nbytes_ // 2), rotation_sets(nbytes_, l2_bytes))
    return _SAME_COPY[nbytes_]


def no_gpu() -> Optional[str]:
    """Why the GPU commands cannot run here (no CuPy, no driver, no device), or None."""
    try:
        import cupy as cp
        if cp.cuda.runtime.getDeviceCount() == 0:
            raise RuntimeError("no CUDA device")
    except Exception as e:  # noqa: BLE001 - any failure to reach a device is the answer
        return f"{type(e).__name__}: {e}"
    return None


def free_memory():
    """Give the blocks CuPy's and torch's allocators cache back to the device (between workloads)."""
    import cupy as cp
    cp.get_default_memory_pool().free_all_blocks()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
