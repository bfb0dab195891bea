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
# setmaxnreg takes multiples of 8 in [24, 256].
SETMAXNREG_MIN, SETMAXNREG_MAX, SETMAXNREG_STEP = 24, 256, 8


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
        if total > REGISTERS_PER_SM:
            raise ValueError(f"{self}: {total} registers for one CTA, the SM has {REGISTERS_PER_SM}")

    @property
    def threads(self) -> int:
        return THREADS_PER_WARPGROUP * (1 + self.consumer_warpgroups)


def register_budget(consumer_warpgroups: int) -> RegisterBudget:
    """The split used with one CTA per SM: the producer keeps the minimum it needs."""
    return {
        2: RegisterBudget(producer=24, consumer=240, consumer_warpgroups=2),
        3: RegisterBudget(producer=32, consumer=160, consumer_warpgroups=3),
        4: RegisterBudget(producer=24, consumer=120, consumer_warpgroups=4),
    }[consumer_warpgroups]
