"""CPU threads of a command (``--threads``), with a default that does not collapse on a shared
machine.

PyTorch's default uses every core for intra-op parallelism. OpenMP worker threads busy-wait
between parallel regions, so when other processes already hold the cores they spin against
them and a command slows about tenfold (router training fell from ~250 to 20 tokens/s on a
2-core machine shared by four jobs). The default here counts only the cores that are free.
"""

from __future__ import annotations

import os

from wide_cli.errors import ConfigError

#: environment variables that size the OpenMP / MKL pools of a process started after they are set.
THREAD_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _busy_cores() -> int:
    """Cores other processes keep busy: the 1-minute load average, rounded down."""
    try:
        return int(os.getloadavg()[0])
    except (AttributeError, OSError):
        return 0


def resolve_threads(requested: int | None) -> int:
    """Intra-op threads for this process.

    ``requested`` (``--threads``) wins; else ``OMP_NUM_THREADS`` when set (by the user or by
    torchrun); else the CPUs this process may use minus the cores the load average says are
    busy, at least 1, divided among torchrun's local processes (``LOCAL_WORLD_SIZE``).

    Raises:
        ConfigError: ``requested`` < 1.
    """
    if requested is not None:
        if requested < 1:
            raise ConfigError(f"--threads {requested} must be >= 1", "omit it for the default (the free cores)")
        return int(requested)
    env = os.environ.get("OMP_NUM_THREADS", "").strip()
    if env.isdigit() and int(env) >= 1:
        return int(env)
    cpus = _cpus()
    free = max(1, min(cpus, cpus - _busy_cores()))
    return max(1, free // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)))


def apply_threads(requested: int | None) -> int:
    """Size this process's thread pools (``resolve_threads``) and export the count in
    ``OMP_NUM_THREADS`` / ``MKL_NUM_THREADS`` so that processes it starts (torchrun) inherit it.
    Call before the command's first tensor operation. Returns the thread count."""
    n = resolve_threads(requested)
    for var in THREAD_ENV:
        os.environ[var] = str(n)
    import torch

    torch.set_num_threads(n)
    try:
        torch.set_num_interop_threads(1)  # inter-op parallelism is unused; only settable once
    except RuntimeError:
        pass
    return n
