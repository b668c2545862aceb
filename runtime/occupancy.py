"""How many programs of a compiled kernel one SM holds at once, and KV splits whose waves of them end sooner.

A decode step's programs read about the same number of KV positions each, so they run in waves: R programs resident
on the GPU at a time, the grid's programs handed out in order (the split index varies slowest, so each sequence's
last, shorter split comes last). A memory-latency-bound kernel (the 8-bit formats at 18% occupancy) runs a partly
filled wave about as long as a full one: at 4 x 65536 the split rule's 33 splits leave 1024 programs with
positions (the 33rd split is empty), 2.59 waves of a kernel that fits 3 per SM on 132 SMs, which cost about 3.
split_makespan models that (each program as long as its loop steps plus PROGRAM_STEPS, the slots filled in grid
order), and wave_splits raises the rule's split count where the model says the step ends at least MIN_GAIN sooner.

H200, 2026-12-02 (benchmarks/RESULTS.md, seventeenth session, `python benchmarks/tune_splits.py`), decode at
4 x 65536: fp8_e4m3 (3 programs per SM) 198 us at the rule's 33 splits, 183 at 37; bf16 (4 per SM, where 33 splits
fill 2.00 waves) 267 us at 33, 304 at 37. Filling the last wave whatever the model said (the first version) lost
2-4% where it only shortened the programs by a step (nvfp4, mxfp4, mixed_k8_v4 at 8 x 32768, 17 -> 18 splits) or
moved a tail of short last splits into full waves (int4 per token-head at 4 x 65536, 17 -> 24).
"""

from __future__ import annotations

import functools
import heapq
from dataclasses import dataclass


@dataclass(frozen=True)
class SMLimits:
    """What one SM holds (sm_90: 64K 32-bit registers, 228 KiB shared memory of which 1 KiB is reserved per block,
    64 warps, 32 blocks)."""

    registers: int = 65536
    shared_bytes: int = 228 * 1024
    reserved_shared_per_block: int = 1024
    warps: int = 64
    blocks: int = 32


HOPPER = SMLimits()


def resident_programs(registers: int, num_warps: int, shared_bytes: int, limits: SMLimits = HOPPER) -> int:
    """Programs of a kernel using ``registers`` per thread, ``num_warps`` warps and ``shared_bytes`` of shared memory
    that one SM runs at once (registers are allocated per warp in units of 256, i.e. per thread in units of 8)."""
    per_warp = -(-max(registers, 1) * 32 // 256) * 256
    by_registers = (limits.registers // per_warp) // num_warps
    by_shared = limits.shared_bytes // (shared_bytes + limits.reserved_shared_per_block)
    return max(1, min(by_registers, by_shared, limits.warps // num_warps, limits.blocks))


# A program's fixed cost (prologue, epilogue, its share of the reduction) in steps of its KV loop, and the least
# predicted gain for which decode leaves the split rule's count
PROGRAM_STEPS = 1
MIN_GAIN = 0.10
# waves beyond which wave_splits does not search: a last wave is then at most 1 / MAX_WAVES of the step, below MIN_GAIN
MAX_WAVES = 16


def split_makespan(programs: int, steps: int, splits: int, resident: int) -> int:
    """The modelled time, in loop steps, of ``programs`` (sequence, query tile, KV head) programs split ``splits``
    ways over ``steps`` loop steps of KV positions on ``resident`` program slots: splits of whole steps (the launch's
    chunk), the last taking the rest and empty ones not counted; each program lasts its steps plus PROGRAM_STEPS,
    whatever else runs beside it; slots take the programs in grid order, all but the last split first. Slots are
    kept in groups freed at the same time, so the work is a few heap operations per wave."""
    steps = max(1, steps)
    chunk = -(-steps // splits)
    live = -(-steps // chunk)
    last = steps - (live - 1) * chunk
    free = [(0, min(resident, programs * live))]  # (time, slots free from then on)
    end = 0
    for length, count in ((chunk, programs * (live - 1)), (last, programs)):
        while count:
            t, slots = heapq.heappop(free)
            taken = min(slots, count)
            heapq.heappush(free, (t + length + PROGRAM_STEPS, taken))
            if slots > taken:
                heapq.heappush(free, (t, slots - taken))
            end = max(end, t + length + PROGRAM_STEPS)
            count -= taken
    return end


@functools.lru_cache(maxsize=4096)
def wave_splits(programs: int, splits: int, steps: int, resident: int, most: int) -> int:
    """The split count for decode of ``steps`` loop steps: the rule's ``splits``, or the count in (splits,
    min(most, 2 * splits)] of least split_makespan where that ends at least MIN_GAIN sooner (the fewest splits among
    equals). ``splits`` itself where the grid fills less than one wave (few programs: none waits for a slot) or more
    than MAX_WAVES. (Cached: PROGRAM_STEPS, MIN_GAIN and MAX_WAVES are read on a key's first call.)"""
    grid = programs * splits
    if grid < resident or grid > MAX_WAVES * resident:
        return splits
    base = split_makespan(programs, steps, splits, resident)
    best, best_time = splits, base
    for s in range(splits + 1, min(most, 2 * splits) + 1):
        t = split_makespan(programs, steps, s, resident)
        if t < best_time:
            best, best_time = s, t
    return best if best_time <= (1 - MIN_GAIN) * base else splits
