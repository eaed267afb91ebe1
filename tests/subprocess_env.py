"""XLA flags for a test's subprocess: its own fake device count plus the session's other flags (tests/conftest.py)."""
import os
import re


def xla_flags(devices: int) -> str:
    others = re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", ""))
    return f"--xla_force_host_platform_device_count={devices} {others}".strip()
