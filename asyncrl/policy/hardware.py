"""What this machine's processor computes natively: bfloat16 (read, never assumed, for `learner.precision`)."""

from __future__ import annotations

from pathlib import Path

CPU_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})
"""/proc/cpuinfo flags of bfloat16 instructions: x86's AVX512-BF16 and AMX-BF16, ARM's BF16 (its "Features")."""


def cpu_has_bf16(cpuinfo: str | Path = "/proc/cpuinfo") -> bool:
    """Whether the CPU lists bfloat16 instructions among its flags; False where `cpuinfo` cannot be read (not
    Linux), since nothing then says they are there. Without them torch emulates bfloat16 matmuls, several
    times slower than float32."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return False
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features") and CPU_BF16_FLAGS & set(value.split()):
            return True
    return False
