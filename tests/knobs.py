"""The test suite's own switches: environment variables the tests read (not the runtime's settings,
docs/configuration.md). Each is read when a test asks for it, with the runtime's parsers
(runtime.config.env_int / env_flag: a bad value is a typed error naming the variable).

    SKUFORGE_SEED=N            the ``rng`` fixture's seed (default: fresh, printed with each test)
    SKUFORGE_EXHAUSTIVE=1      tests/quantization/test_lowbit_host.py: f32 -> fp8 over all 2**32 bit patterns
    SKUFORGE_FULL_COMPILE=1    tests/quantization/test_lowbit_build.py: every low-bit unit for every arch
"""
from typing import Optional

from runtime import config


def seed() -> Optional[int]:
    return config.env_int("SKUFORGE_SEED")


def exhaustive() -> bool:
    return config.env_flag("SKUFORGE_EXHAUSTIVE")


def full_compile() -> bool:
    return config.env_flag("SKUFORGE_FULL_COMPILE")
