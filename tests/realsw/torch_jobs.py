"""Real PyTorch jobs in the hang shapes hangwatch must tell apart, and in healthy ones.

Runs under the cached real-software venv (``scripts/realsw.py`` knows its python and torchrun),
never under the project's ``.venv``. gloo on CPU, small tensors, one intra-op thread per process.
Each process prints one flushed ``READY shape=NAME rank=R pid=P role=ROLE`` line when it has
reached its state; the shapes that keep working also print ``STEP ...`` lines.

    torchrun --nproc_per_node=2 --master_addr=127.0.0.1 --master_port=PORT \\
        tests/realsw/torch_jobs.py --shape allreduce_peer_gone

Shapes (truth in brackets; tests/realsw/README.md has the table):

* ``allreduce_peer_gone`` [stalled], torchrun 2 ranks: rank 1 stops taking part (blocks forever
  on a ``threading.Event``), rank 0 blocks in ``all_reduce``.
* ``rendezvous_peer_missing`` [stalled], run directly (no torchrun): rank 0 of a world of 2 calls
  ``init_process_group``; rank 1 is never started, so rank 0 waits in the TCPStore rendezvous.
  (The other form, ``torchrun --nnodes=2`` without its second node, never starts this script:
  ``scripts/realsw.py`` launches that one.)
* ``compute_before_collective`` [progressing], torchrun 2 ranks: both compute (matmuls) before
  their first collective.
* ``barrier_behind_compute`` [progressing], torchrun 2 ranks: rank 0 waits in ``dist.barrier``
  while rank 1 computes for ``--compute-seconds``; then both pass it, print ``STEP`` and repeat.
* ``dataloader_worker_stuck`` [stalled], run directly: a ``DataLoader`` (``num_workers=1``) whose
  worker blocks forever in ``__getitem__``; the main process waits for the batch.
* ``training_loop`` [progressing], torchrun 2 ranks: a DDP training loop that works; rank 0 logs a
  ``STEP`` line every ``--log-seconds``. It runs as one job over two nodes too.

One job over two nodes (``torchrun --nnodes=2 --nproc_per_node=2``, 4 ranks), where one rank
(``--odd-rank``, default 2) is the one the others wait for; every rank prints READY once in place:

* ``job_dataloader_stuck``: each rank loops over its DataLoader (``num_workers=1``) and all-reduces
  each batch; the odd rank's worker blocks forever on its third item, so the odd rank waits for
  its batch while the others wait in ``all_reduce``.
* ``job_other_collective``: the odd rank calls ``barrier`` where the others call ``all_reduce`` (a
  mismatched call order: gloo waits forever on both sides).
* ``job_rank_killed``: the odd rank parks (the test kills it); the others create a new group,
  which waits in the store for every rank. Its node's agent then tears down its other rank too,
  whose connections close unread: the ranks of the other node wait on.
* ``job_long_compute``: the odd rank computes for ``--compute-seconds`` (default forever) while
  the others wait in ``all_reduce``.
* ``job_event_stuck``: the odd rank stops taking part (blocks forever on a ``threading.Event``)
  while the others block in ``all_reduce``.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from datetime import timedelta
from typing import Any

TORCHRUN_SHAPES = (
    "allreduce_peer_gone",
    "compute_before_collective",
    "barrier_behind_compute",
    "training_loop",
)
DIRECT_SHAPES = ("rendezvous_peer_missing", "dataloader_worker_stuck")
JOB_SHAPES = (
    "job_dataloader_stuck",
    "job_other_collective",
    "job_rank_killed",
    "job_long_compute",
    "job_event_stuck",
)
SHAPES = TORCHRUN_SHAPES + DIRECT_SHAPES + JOB_SHAPES


def announce(token: str, **fields: object) -> None:
    """One ``TOKEN key=value ...`` line in a single write(2): the ranks share torchrun's stdout,
    and print() under ``python -u`` (as torchrun starts them) writes word by word."""
    line = " ".join([token, *(f"{k}={v}" for k, v in fields.items())])
    os.write(sys.stdout.fileno(), line.encode() + b"\n")


def block_forever() -> None:
    """Park the calling thread in futex(2) with no timeout: nothing ever sets the event."""
    threading.Event().wait()


class Job:
    def __init__(self, args: argparse.Namespace) -> None:
        import torch  # not at module level: --help and argument errors stay fast

        self.torch = torch
        self.args = args
        self.shape = args.shape
        torch.set_num_threads(1)  # kind to small machines; torchrun also sets OMP_NUM_THREADS=1
        self.rank = int(os.environ.get("RANK", "0"))
        self.world_size = int(os.environ.get("WORLD_SIZE", "1"))

    def ready(self, role: str, **fields: object) -> None:
        announce("READY", shape=self.shape, rank=self.rank, pid=os.getpid(), role=role, **fields)

    def init_group(self) -> Any:
        import torch.distributed as dist

        dist.init_process_group(
            "gloo",
            rank=self.rank,
            world_size=self.world_size,
            timeout=timedelta(seconds=self.args.timeout),
        )
        return dist

    def compute(self, seconds: float) -> int:
        """Matmuls for ``seconds`` of wall time (forever if negative); how many were done."""
        torch = self.torch
        a = torch.randn(128, 128)
        b = torch.randn(128, 128) / 16
        done = 0
        deadline = time.monotonic() + seconds
        while seconds < 0 or time.monotonic() < deadline:
            a = torch.tanh(a @ b)
            done += 1
        return done

    # --- the shapes ---------------------------------------------------------------------------

    def allreduce_peer_gone(self) -> None:
        dist = self.init_group()
        t = self.torch.ones(16)
        dist.all_reduce(t)  # one collective that works: both ranks are really in the group
        if self.rank == 0:
            self.ready("waiter", collective="all_reduce")
            dist.all_reduce(t)  # rank 1 never joins
            announce("UNEXPECTED", what="all_reduce returned")
        else:
            self.ready("gone")
            block_forever()

    def rendezvous_peer_missing(self) -> None:
        # What torchrun would set; rank 1 of the world of 2 is simply never started.
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        if "MASTER_PORT" not in os.environ:
            sys.exit("rendezvous_peer_missing needs MASTER_PORT (a free port)")
        self.rank, self.world_size = 0, 2
        self.ready("waiter", port=os.environ["MASTER_PORT"])
        self.init_group()
        announce("UNEXPECTED", what="init_process_group returned")

    def compute_before_collective(self) -> None:
        dist = self.init_group()
        self.ready("computer")
        done = self.compute(self.args.compute_seconds)
        dist.all_reduce(self.torch.ones(16))
        announce("DONE", rank=self.rank, matmuls=done)
        block_forever()

    def barrier_behind_compute(self) -> None:
        dist = self.init_group()
        step = 0
        self.ready("waiter" if self.rank == 0 else "computer")
        while True:
            started = time.monotonic()
            if self.rank != 0:
                self.compute(self.args.compute_seconds)
            dist.barrier()
            step += 1
            if self.rank == 0:
                announce("STEP", step=step, waited=f"{time.monotonic() - started:.2f}")

    def dataloader_worker_stuck(self) -> None:
        from torch.utils.data import DataLoader, Dataset

        shape = self.shape

        class StuckDataset(Dataset):
            def __len__(self) -> int:
                return 4

            def __getitem__(self, index: int) -> Any:
                announce("READY", shape=shape, rank=0, pid=os.getpid(), role="worker")
                block_forever()

        loader = DataLoader(StuckDataset(), batch_size=2, num_workers=1)
        self.ready("main")
        next(iter(loader))
        announce("UNEXPECTED", what="got a batch")

    # --- one job over two nodes: the odd rank out ------------------------------------------

    def job_dataloader_stuck(self) -> None:
        from torch.utils.data import DataLoader, Dataset

        torch, dist = self.torch, self.init_group()
        odd = self.rank == self.args.odd_rank

        class Steps(Dataset):
            def __len__(self) -> int:
                return 1000

            def __getitem__(self, index: int) -> Any:
                if odd and index == 2:
                    block_forever()  # a read that never returns (a hung filesystem)
                return torch.ones(4)

        loader = DataLoader(Steps(), batch_size=1, num_workers=1)
        for step, batch in enumerate(loader):  # the odd rank waits here for its batch
            dist.all_reduce(batch)  # the others wait here for the odd rank
            if step == 1:
                self.ready("stuck" if odd else "waiter")

    def job_other_collective(self) -> None:
        dist = self.init_group()
        t = self.torch.ones(16)
        dist.all_reduce(t)
        odd = self.rank == self.args.odd_rank
        self.ready("barrier" if odd else "waiter")
        if odd:
            dist.barrier()  # where the others all-reduce: a mismatched call order
        else:
            dist.all_reduce(t)  # the collective the odd rank never calls
        announce("UNEXPECTED", what="a mismatched collective returned", rank=self.rank)
        block_forever()

    def job_rank_killed(self) -> None:
        dist = self.init_group()
        dist.all_reduce(self.torch.ones(16))
        odd = self.rank == self.args.odd_rank
        self.ready("gone" if odd else "waiter")
        if odd:
            block_forever()  # until the test kills it
        dist.new_group(backend="gloo")  # waits in the store for every rank to join
        announce("UNEXPECTED", what="new_group returned", rank=self.rank)
        block_forever()

    def job_long_compute(self) -> None:
        dist = self.init_group()
        t = self.torch.ones(16)
        dist.all_reduce(t)
        odd = self.rank == self.args.odd_rank
        self.ready("computer" if odd else "waiter")
        if odd:
            self.compute(self.args.compute_seconds)
        dist.all_reduce(t)  # the others wait here while the odd rank computes
        announce("DONE", rank=self.rank)
        block_forever()

    def job_event_stuck(self) -> None:
        dist = self.init_group()
        t = self.torch.ones(16)
        dist.all_reduce(t)
        odd = self.rank == self.args.odd_rank
        self.ready("stuck" if odd else "waiter")
        if odd:
            threading.Event().wait()  # the odd rank stops taking part here
        dist.all_reduce(t)  # the others wait here for the rank on the Event
        announce("UNEXPECTED", what="an all_reduce without the odd rank returned", rank=self.rank)
        block_forever()

    def training_loop(self) -> None:
        torch = self.torch
        dist = self.init_group()
        from torch.nn.parallel import DistributedDataParallel

        torch.manual_seed(self.rank)
        model = DistributedDataParallel(
            torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
        )
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        x, y = torch.randn(64, 32), torch.randn(64, 1)
        step = 0
        next_log = time.monotonic()
        while True:
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()  # DDP all-reduces the gradients through gloo
            opt.step()
            step += 1
            if step == 1:
                self.ready("trainer")
            if self.rank == 0 and time.monotonic() >= next_log:
                announce("STEP", step=step, loss=f"{loss.item():.4f}")
                next_log += self.args.log_seconds
            if self.args.max_steps and step >= self.args.max_steps:
                dist.destroy_process_group()
                return


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", required=True, choices=SHAPES)
    parser.add_argument(
        "--compute-seconds",
        type=float,
        default=-1.0,
        help="compute_before_collective: how long before the collective (default forever); "
        "barrier_behind_compute: per step on rank 1 (default 2)",
    )
    parser.add_argument("--log-seconds", type=float, default=1.0, help="training_loop")
    parser.add_argument(
        "--odd-rank", type=int, default=2, help="job_*: the rank the others wait for"
    )
    parser.add_argument("--max-steps", type=int, default=0, help="training_loop (0: forever)")
    parser.add_argument(
        "--timeout",
        type=float,
        default=3600.0,
        help="process group timeout in seconds: how long a hang lasts before torch gives up",
    )
    args = parser.parse_args(argv)
    if args.shape == "barrier_behind_compute" and args.compute_seconds < 0:
        args.compute_seconds = 2.0
    under_torchrun = "TORCHELASTIC_RUN_ID" in os.environ
    if args.shape in (*TORCHRUN_SHAPES, *JOB_SHAPES) and not under_torchrun:
        parser.error(f"--shape {args.shape} runs under torchrun --nproc_per_node=2")
    if args.shape in DIRECT_SHAPES and under_torchrun:
        parser.error(f"--shape {args.shape} runs directly, not under torchrun")
    job = Job(args)
    getattr(job, args.shape)()
    return 0


if __name__ == "__main__":
    sys.exit(main())
