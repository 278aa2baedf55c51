"""The device spec of a machine from its measured profile, and the per-machine cache of
profiles that ``parallelism.auto`` probes once and reads afterwards.

The cache lives under ``$XDG_CACHE_HOME/autopar/profiles`` (``~/.cache/autopar/profiles``;
``$AUTOPAR_CACHE_DIR/profiles`` where that is set), one file per device name, torch version,
probe version and world shape, since each of them changes the figures. Only the first local
rank probes; the others wait for its file, so every rank of a node plans with the same figures
and the probe is not slowed by its neighbours.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable
from pathlib import Path

import torch

from autopar.config.checks import unwritable
from autopar.config.errors import ConfigError
from autopar.planner.devices import PRESETS, DeviceSpec
from autopar.planner.profile import DeviceProfile, load_profile

WAIT_FOR_PROBE_S = 300.0
"""How long a rank other than the first waits for the first one's probe."""


def cache_dir() -> Path:
    """``$AUTOPAR_CACHE_DIR/profiles`` where set (a cluster's shared home, a test session),
    else ``$XDG_CACHE_HOME/autopar/profiles``."""
    if os.environ.get("AUTOPAR_CACHE_DIR"):
        return Path(os.environ["AUTOPAR_CACHE_DIR"]) / "profiles"
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "autopar" / "profiles"


PROBE_VERSION = 5
"""Raised whenever what the probe measures, or how, changes, so that a profile cached by an
older probe is measured again rather than trusted: 2, its models initialized (their norms had
held whatever memory held); 3, the job's step timed as training runs it; 4, that step at one
sequence too, checkpointing's machinery, and CP's own k/v gather."""


def cache_path(device: str, world_size: int, local_world_size: int, folder: Path | None = None) -> Path:
    """Where this machine's profile is cached: keyed by device name, torch version, probe
    version and world shape."""
    slug = re.sub(
        r"[^a-z0-9.]+", "-", f"{device} torch{torch.__version__} probe{PROBE_VERSION}".lower()
    ).strip("-")
    return (folder or cache_dir()) / f"{slug}-w{world_size}-l{local_world_size}.json"


def spec_from_profile(profile: DeviceProfile) -> DeviceSpec:
    """A device spec that plans with ``profile``: the matching preset's peaks (for MFU) and
    inter-node link where the device is one, else the measured best; the measured memory,
    memory and host bandwidth, and the measured collectives within a node."""
    name = profile.device.lower()
    preset = next((p for key, p in PRESETS.items() if profile.device_type == "cuda" and key in name), None)
    link = profile.collective_peak()
    peak = profile.peak_flops
    return DeviceSpec(
        name=profile.device,
        memory_gib=profile.memory_gib,
        bf16_flops=preset.bf16_flops if preset else peak,
        fp8_flops=(preset.fp8_flops if preset else None)
        if not any(p.dtype == "float8" for p in profile.matmul)
        else max(p.flops_per_s for p in profile.matmul if p.dtype == "float8"),
        hbm_bytes_per_s=profile.memory_bytes_per_s,
        intra_node_bytes_per_s=link
        or (preset.intra_node_bytes_per_s if preset else profile.memory_bytes_per_s),
        inter_node_bytes_per_s=preset.inter_node_bytes_per_s
        if preset
        else (link or profile.memory_bytes_per_s),
        host_bytes_per_s=profile.host_bytes_per_s or profile.memory_bytes_per_s,
        profile=profile,
    )


def probed_device(
    device: torch.device,
    world_size: int,
    local_world_size: int,
    probe: Callable[[torch.device, int], DeviceProfile],
    folder: Path | None = None,
) -> DeviceSpec:
    """This machine's spec from its cached profile, probing (first local rank) or waiting for
    the probe (the others) when there is none yet."""
    from autopar.planner.probe import device_name

    path = cache_path(device_name(device), world_size, local_world_size, folder)
    if not path.is_file():
        problem = unwritable(path.parent)  # before the probe's minutes, not after them
        if problem is not None:
            raise ConfigError(
                f"{_cache_origin(folder)}: parallelism.auto cannot cache this machine's device profile in "
                f"{path.parent}: {problem}; point AUTOPAR_CACHE_DIR at a folder you can write"
            )
        if int(os.environ.get("LOCAL_RANK", "0")) == 0:
            profile = probe(device, local_world_size)
            scratch = path.with_suffix(f".{os.getpid()}.tmp")
            profile.save(scratch)
            scratch.replace(path)  # the others never read half a file
        else:
            _wait_for(path)
    fix = (
        "write it again with python -m autopar.probe --cache, or delete it and parallelism.auto probes again"
    )
    return spec_from_profile(load_profile(path, "the cached device profile", fix))


def _cache_origin(folder: Path | None) -> str:
    """What named the cache folder, as the user set it."""
    if folder is not None:
        return f"the profile cache {folder}"
    if os.environ.get("AUTOPAR_CACHE_DIR"):
        return f"AUTOPAR_CACHE_DIR={os.environ['AUTOPAR_CACHE_DIR']}"
    return f"the profile cache {cache_dir()} (XDG_CACHE_HOME, else ~/.cache)"


def _wait_for(path: Path) -> None:
    deadline = time.monotonic() + WAIT_FOR_PROBE_S
    while not path.is_file():
        if time.monotonic() > deadline:
            raise ConfigError(
                f"parallelism.auto: local rank 0 wrote no device profile to {path} within "
                f"{WAIT_FOR_PROBE_S:g} s; run python -m autopar.probe --cache once on this machine"
            )
        time.sleep(0.5)


def auto_probe(device: torch.device, local_world_size: int) -> DeviceProfile:
    """What auto measures itself: matmuls, memory and host copies (no process group exists
    before the plan is chosen; ``autopar-probe --cache`` under torchrun adds the collectives)."""
    from autopar.planner.probe import run_probe

    return run_probe(device, local_world=local_world_size)
