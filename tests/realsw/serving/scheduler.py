"""The scheduler process, shaped like SGLang's ``Scheduler``.

Start-up, in SGLang's order: zmq sockets (PULL bound for the tokenizer manager, PUSH connected
to the detokenizer), the watchdog thread, then the model weights, with a progress line per MiB
in the log; then ``{"status": "ready"}`` on the pipe to the root process. The event loop takes
every queued request without blocking, runs one decode step for the running batch and sends
its tokens to the detokenizer; with nothing to run it sleeps in ``zmq.Poller.poll(1000)``
(SGLang's IdleSleeper, ``--sleep-on-idle``).

The hang shapes start at the first decode step, i.e. when the first request arrives, so that
request stays unanswered. Each sends ``{"status": "hung", ...}`` with the threads it parked
and then blocks the event loop for good.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import multiprocessing as mp
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import zmq

from .common import IpcNames, SchedulerConfig, get_zmq_socket, setup_logging
from .weights import load_from_file, load_from_tcp

logger = logging.getLogger("scheduler")
DECODE_LOG_INTERVAL = 40  # SGLang's default: one "Decode batch" line every 40 steps
SLICE = 256 * 1024  # bytes of weights one token's "forward" reads


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, ipc: IpcNames, status: Connection) -> None:
        self.cfg = cfg
        self.status = status
        context = zmq.Context(2)
        self.recv_from_tokenizer = get_zmq_socket(context, zmq.PULL, ipc.scheduler_input, True)
        self.send_to_detokenizer = get_zmq_socket(context, zmq.PUSH, ipc.detokenizer, False)
        self.idle_sleeper = zmq.Poller()
        self.idle_sleeper.register(self.recv_from_tokenizer, zmq.POLLIN)
        self.running: list[dict[str, Any]] = []
        self.forward_ct = 0
        self.num_generated = 0
        self.last_log = time.monotonic()
        self.hung = False
        if cfg.watchdog_timeout > 0:
            threading.Thread(target=self.watchdog, name="watchdog", daemon=True).start()
        self.weights = self.load_weights()
        self.status.send({"status": "ready", "weights_mib": len(self.weights) >> 20})

    def load_weights(self) -> bytearray:
        kind, _, where = self.cfg.weights.partition(":")

        def first_progress() -> None:
            self.status.send({"status": "loading"})

        if kind == "tcp":
            host, _, port = where.rpartition(":")
            return load_from_tcp(host, int(port), first_progress, self.cfg.log_every_mib)
        if kind == "file":
            return load_from_file(Path(where), first_progress)
        raise ValueError(f"--weights {self.cfg.weights!r}: expected file:PATH or tcp:HOST:PORT")

    def watchdog(self) -> None:
        """SGLang's watchdog: every timeout/2 s, check that a running batch made progress.

        Real SGLang then dumps stacks and SIGQUITs its parent; here it logs once and stops, so
        that a hang shape stays what it is however long it is watched.
        """
        timeout = self.cfg.watchdog_timeout
        last_ct, last_time = self.forward_ct, time.monotonic()
        while True:
            now = time.monotonic()
            if self.running and self.forward_ct == last_ct:
                if now > last_time + timeout:
                    logger.error("Watchdog timeout (watchdog_timeout=%s)", timeout)
                    return
            else:
                last_ct, last_time = self.forward_ct, now
            time.sleep(timeout // 2)

    # --- the event loop -------------------------------------------------------------------

    def event_loop(self) -> None:
        while True:
            self.running += self.recv_requests()
            if self.running:
                self.run_batch()
            else:
                self.idle_sleeper.poll(1000)

    def recv_requests(self) -> list[dict[str, Any]]:
        reqs = []
        while True:
            try:
                reqs.append(self.recv_from_tokenizer.recv_pyobj(zmq.NOBLOCK))
            except zmq.ZMQError:
                return reqs

    def run_batch(self) -> None:
        if not self.hung and self.cfg.shape in HANGS:
            self.hung = True
            HANGS[self.cfg.shape](self)  # never returns
        out: dict[str, list[Any]] = {"rids": [], "token_ids": [], "finished": []}
        for req in self.running:
            req["output_ids"].append(self.forward(req))
            out["rids"].append(req["rid"])
            out["token_ids"].append(req["output_ids"][-1])
            out["finished"].append(len(req["output_ids"]) >= req["max_new_tokens"])
        self.send_to_detokenizer.send_pyobj(out)
        self.num_generated += len(self.running)
        self.running = [r for r, done in zip(self.running, out["finished"]) if not done]
        self.forward_ct += 1
        if self.forward_ct % DECODE_LOG_INTERVAL == 0:
            now = time.monotonic()
            logger.info(
                "Decode batch. #running-req: %d, gen throughput (token/s): %.2f",
                len(self.running),
                self.num_generated / (now - self.last_log),
            )
            self.num_generated, self.last_log = 0, now

    def forward(self, req: dict[str, Any]) -> int:
        """One token: a checksum of a slice of the weights chosen by the sequence so far."""
        pos = len(req["input_ids"]) + len(req["output_ids"])
        off = (sum(req["input_ids"]) + pos * 4099 * 1024) % max(len(self.weights) - SLICE, 1)
        return hashlib.sha256(memoryview(self.weights)[off : off + SLICE]).digest()[0]

    # --- the hang shapes ------------------------------------------------------------------

    def hang_abba(self) -> None:
        """Two worker threads take the KV-cache lock and the weights lock in opposite orders,
        in two methods, as a real scheduler would: eviction and a weight update."""
        self.kv_lock, self.weights_lock = threading.Lock(), threading.Lock()
        self.meet = threading.Barrier(3)  # both hold their first lock, and we know their TIDs
        workers = [
            threading.Thread(target=self.evict_kv_cache, name="tp-worker-0"),
            threading.Thread(target=self.update_weights, name="tp-worker-1"),
        ]
        for t in workers:
            t.start()
        self.meet.wait()
        self.announce_hang(tids=[t.native_id for t in workers])
        for t in workers:
            t.join()

    def evict_kv_cache(self) -> None:
        with self.kv_lock:
            self.meet.wait()
            with self.weights_lock:  # held by update_weights, which waits for kv_lock
                pass

    def update_weights(self) -> None:
        with self.weights_lock:
            self.meet.wait()
            with self.kv_lock:  # held by evict_kv_cache, which waits for weights_lock
                pass

    def hang_native(self) -> None:
        """The same cycle inside a C library: pthread mutexes, called through ctypes."""
        assert self.cfg.native_lib, "native-abba needs the path of libabba.so"
        lib = ctypes.CDLL(self.cfg.native_lib)
        if lib.abba_init() != 0:
            raise OSError("pthread_barrier_init failed")
        words = [ctypes.addressof(ctypes.c_int.in_dll(lib, n)) for n in ("abba_a", "abba_b")]
        workers = [
            threading.Thread(target=lib.abba_ab, name="kernel-0"),
            threading.Thread(target=lib.abba_ba, name="kernel-1"),
        ]
        for t in workers:
            t.start()
        self.announce_hang(tids=[t.native_id for t in workers], words=words)
        for t in workers:
            t.join()

    def hang_fork(self) -> None:
        """Fork a helper while the cache thread holds ``cache_lock``; the helper takes it.

        In the parent the cache thread releases the lock and exits; in the child no thread
        owns it any more, so the helper waits forever. The scheduler waits for the helper the
        way ``multiprocessing`` does: ``join(5)`` in a loop, i.e. poll(2) on the sentinel pipe
        with a 5 s timeout.
        """
        cache_lock = threading.Lock()
        held, release = threading.Event(), threading.Event()

        def evict() -> None:
            with cache_lock:
                held.set()
                release.wait()

        evictor = threading.Thread(target=evict, name="cache-evict")
        evictor.start()
        held.wait()
        helper = mp.get_context("fork").Process(
            target=_helper, args=(cache_lock,), name="grammar-helper"
        )
        helper.start()
        release.set()
        evictor.join()
        logger.info("Waiting for helper process %d", helper.pid)
        self.announce_hang(child=helper.pid)
        while helper.exitcode is None:
            helper.join(5)

    def announce_hang(self, **info: Any) -> None:
        self.status.send({"status": "hung", "joiner": threading.get_native_id(), **info})


def _helper(cache_lock: threading.Lock) -> None:
    with cache_lock:  # a copy of a lock held, at fork time, by a thread the child does not have
        pass


HANGS = {
    "abba": Scheduler.hang_abba,
    "abba-retry": Scheduler.hang_abba,
    "native-abba": Scheduler.hang_native,
    "fork-lock": Scheduler.hang_fork,
}


def run_scheduler_process(cfg: SchedulerConfig, ipc: IpcNames, status: Connection) -> None:
    """The target of the scheduler's ``multiprocessing.Process`` (spawned, as SGLang does)."""
    setup_logging(cfg.log, "scheduler TP0")
    try:
        scheduler = Scheduler(cfg, ipc, status)
    except BaseException as e:
        status.send({"status": "failed", "error": repr(e)})
        raise
    scheduler.event_loop()
