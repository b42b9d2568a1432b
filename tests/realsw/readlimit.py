"""A cap on how fast a process tree reads storage: a cgroup with a read-bytes-per-second limit
on the disk that holds a path (cgroup v2 ``io.max``, or v1 ``blkio.throttle``).

A loading fixture reads its weights from storage, but how long that takes depends on the
storage: a fast disk read a 4.9 GB model in 6 s, too short for a 5 s diagnose to end
before the load did. Under the cap the load reads storage all along, only slower, so its
shape stays the real one (positive evidence of storage reads), and it lasts until the test
lifts the cap (``release``): the gate is the test's, not a clock's.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

from scripts.fixturelib import FixtureError

V2_ROOT = Path("/sys/fs/cgroup")
V1_BLKIO = Path("/sys/fs/cgroup/blkio")


def disk_of(path: Path) -> str:
    """``MAJ:MIN`` of the whole disk that holds ``path``: blk-throttle takes no partitions."""
    st = os.stat(path)
    dev = f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    sysfs = Path("/sys/dev/block") / dev
    if not sysfs.exists():
        raise FixtureError(f"{path} is on {dev}, not a block device: its reads cannot be capped")
    if (sysfs / "partition").exists():
        dev = (sysfs.resolve().parent / "dev").read_text().strip()
    return dev


class ReadLimit:
    """A fresh cgroup whose members read ``disk_of(path)`` at ``bps`` bytes a second at most.
    A process joins it by writing its PID to ``procs``; its children are born in it."""

    def __init__(self, path: Path, bps: int, name: str = "hangwatch-readlimit") -> None:
        self.disk = disk_of(path)
        self.bps = bps
        self.name = f"{name}-{os.getpid()}"
        self.dir: Path | None = None

    @property
    def procs(self) -> Path:
        assert self.dir is not None, "not entered"
        return self.dir / "cgroup.procs"

    def __enter__(self) -> ReadLimit:
        v2 = V2_ROOT / "cgroup.controllers"
        if v2.exists() and "io" in v2.read_text().split():
            with contextlib.suppress(OSError):  # already on, or set by the host's manager
                (V2_ROOT / "cgroup.subtree_control").write_text("+io")
            self.dir = V2_ROOT / self.name
            self.dir.mkdir(exist_ok=True)
            (self.dir / "io.max").write_text(f"{self.disk} rbps={self.bps}")
        elif (V1_BLKIO / "blkio.throttle.read_bps_device").exists():
            self.dir = V1_BLKIO / self.name
            self.dir.mkdir(exist_ok=True)
            (self.dir / "blkio.throttle.read_bps_device").write_text(f"{self.disk} {self.bps}")
        else:
            raise FixtureError("no cgroup io controller (v2 io.max or v1 blkio) to cap reads")
        return self

    def release(self) -> None:
        """Lift the cap: the members read at the disk's own pace from now on."""
        assert self.dir is not None, "not entered"
        if self.dir.parent == V2_ROOT:
            (self.dir / "io.max").write_text(f"{self.disk} rbps=max")
        else:  # v1: a limit of 0 removes the device's rule
            (self.dir / "blkio.throttle.read_bps_device").write_text(f"{self.disk} 0")

    def __exit__(self, *exc: object) -> None:
        if self.dir is None:
            return
        # the members are killed by then; a cgroup is removable once its last one is reaped
        deadline = time.monotonic() + 10
        while True:
            try:
                self.dir.rmdir()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        self.dir = None
