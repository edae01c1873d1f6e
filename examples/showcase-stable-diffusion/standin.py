"""The CUDA stand-in for the showcase: with SD_STANDIN=cuda-probe the app shows what `cuda-probe` (the project's
stand-in for a CUDA program, in registry.local/gpu-dra/cuda-probe:1) sees instead of loading the model, so the
manifests, the claims and the MPS sharing can be tried without a GPU. No Streamlit or torch here."""
from __future__ import annotations

import os
import subprocess

STANDIN_ENV = "SD_STANDIN"
PROBE_ENV = "CUDA_PROBE"   # path of the probe binary (default: cuda-probe on PATH)
MPS_ENV = ("CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT")


def standin_enabled(env: dict[str, str] | None = None) -> bool:
    return (env if env is not None else dict(os.environ)).get(STANDIN_ENV, "") == "cuda-probe"


def probe_report(env: dict[str, str] | None = None, timeout: float = 30.0) -> list[str]:
    """The probe's lines (devices CUDA and NVML show this container), then the MPS limits the claim set."""
    env = env if env is not None else dict(os.environ)
    probe = env.get(PROBE_ENV, "cuda-probe")
    try:
        proc = subprocess.run([probe], capture_output=True, text=True, timeout=timeout, env=env)
        lines = (proc.stdout + proc.stderr).splitlines()
    except (OSError, subprocess.TimeoutExpired) as exc:
        lines = [f"{probe}: {exc}"]
    return lines + [f"{k}={env[k]}" for k in MPS_ENV if k in env]
