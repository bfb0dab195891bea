"""Warp roles and register budgets of warp-specialized kernels.

Warpgroup 0 is the producer (one of its warps issues TMA); warpgroups 1.. are consumers.
``setmaxnreg`` moves registers from the producer, which only needs addresses and loop
counters, to the consumers, which hold the S and O accumulators.
"""

from __future__ import annotations

from dataclasses import dataclass

THREADS_PER_WARP = 32
THREADS_PER_WARPGROUP = 128
# An SM has 64K 32-bit registers for all resident threads.
REGISTERS_PER_SM = 64 * 1024
# setmaxnreg takes multiples of 8 in [24, 256]; registers are allocated in the same steps.
SETMAXNREG_MIN, SETMAXNREG_MAX, SETMAXNREG_STEP = 24, 256, 8


def launch_registers(threads: int) -> int:
    """Registers a thread gets at launch when one CTA of ``threads`` fills the SM: the 64K
    split evenly, rounded down to the allocation step. Their sum is the CTA's pool, which
    setmaxnreg only redistributes: an .inc beyond it waits forever."""
    return REGISTERS_PER_SM // threads // SETMAXNREG_STEP * SETMAXNREG_STEP


@dataclass(frozen=True)
class RegisterBudget:
    """Per-thread registers after ``setmaxnreg``, for one producer and N consumer warpgroups."""

    producer: int
    consumer: int
    consumer_warpgroups: int

    def __post_init__(self) -> None:
        for name, regs in (("producer", self.producer), ("consumer", self.consumer)):
            if regs % SETMAXNREG_STEP or not SETMAXNREG_MIN <= regs <= SETMAXNREG_MAX:
                raise ValueError(f"{name} registers {regs}: setmaxnreg needs a multiple of 8 in [24, 256]")
        total = THREADS_PER_WARPGROUP * (self.producer + self.consumer * self.consumer_warpgroups)
        pool = self.threads * launch_registers(self.threads)
        if total > pool:
            raise ValueError(f"{self}: {total} registers after setmaxnreg, the CTA's pool at launch holds {pool}")

    @property
    def threads(self) -> int:
        return THREADS_PER_WARPGROUP * (1 + self.consumer_warpgroups)


def register_budget(consumer_warpgroups: int) -> RegisterBudget:
    """The split used with one CTA per SM: the producer keeps the minimum it needs."""
    return {
        2: RegisterBudget(producer=24, consumer=240, consumer_warpgroups=2),
        3: RegisterBudget(producer=32, consumer=160, consumer_warpgroups=3),
        # 640 threads launch with 96 registers each (61440): 24 x 128 + 112 x 512 = 60416.
        4: RegisterBudget(producer=24, consumer=112, consumer_warpgroups=4),
    }[consumer_warpgroups]
