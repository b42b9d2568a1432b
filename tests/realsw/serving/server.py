"""A serving stack built the way SGLang is, put into one of its shapes (see README.md).

Root process: the front-end, uvicorn + FastAPI, with the tokenizer manager (zmq.asyncio) on
uvicorn's event loop. It starts two ``multiprocessing`` children with the spawn method, as
SGLang does: the scheduler (loads the weights, runs decode steps) and the detokenizer. They talk
over pyzmq PUSH/PULL ``ipc://`` sockets: front-end -> scheduler -> detokenizer -> front-end.
Every process logs to ``--log``.

    python -m tests.realsw.serving.server --shape idle --port 0 --log /tmp/serving.log

On stdout, flushed: ``LISTENING pid=P port=N`` once uvicorn listens, then one
``READY shape=S pid=P port=N scheduler=P detokenizer=P loop=L ...`` once the shape is reached
(for a hang: the threads are parked and a request is waiting). Both come from a short-lived
announcer thread in the root process that exits after READY.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import multiprocessing as mp
import os
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import uvicorn
import zmq
import zmq.asyncio
from fastapi import FastAPI, Response
from pydantic import BaseModel

from .common import SHAPES, IpcNames, SchedulerConfig, get_zmq_socket, setup_logging
from .detokenizer import run_detokenizer_process
from .procview import futex_parked, listen_queue
from .scheduler import run_scheduler_process

logger = logging.getLogger("frontend")


# --- the front-end: SGLang's TokenizerManager and its HTTP routes -----------------------------


class GenerateReqInput(BaseModel):
    text: str
    max_new_tokens: int = 8


@dataclass
class ReqState:
    future: asyncio.Future[str]
    text: str = ""


@dataclass
class TokenizerManager:
    ipc: IpcNames
    rid_to_state: dict[str, ReqState] = field(default_factory=dict)
    received: int = 0
    answered: int = 0
    loop_kind: str = "?"  # asyncio or uvloop: whichever uvicorn's loop="auto" picked
    # Taken, briefly, by every /generate: a threading.Lock inside async code, harmless until
    # something holds it (the blocked-loop shape's weight update).
    model_update_lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        context = zmq.asyncio.Context(2)
        self.recv_from_detokenizer = get_zmq_socket(context, zmq.PULL, self.ipc.tokenizer, True)
        self.send_to_scheduler = get_zmq_socket(context, zmq.PUSH, self.ipc.scheduler_input, False)

    async def generate(self, req: GenerateReqInput) -> dict[str, Any]:
        with self.model_update_lock:  # on the event loop's thread
            pass
        rid = uuid.uuid4().hex
        state = ReqState(asyncio.get_running_loop().create_future())
        self.rid_to_state[rid] = state
        self.received += 1
        input_ids = list(req.text.encode())
        msg = {"rid": rid, "input_ids": input_ids, "output_ids": []}
        await self.send_to_scheduler.send_pyobj({**msg, "max_new_tokens": req.max_new_tokens})
        try:
            text = await state.future  # resolved by handle_loop when the last token arrives
        finally:
            del self.rid_to_state[rid]
        self.answered += 1
        meta = {"id": rid, "prompt_tokens": len(input_ids), "completion_tokens": len(text)}
        return {"text": text, "meta_info": meta}

    async def handle_loop(self) -> None:
        while True:
            out = await self.recv_from_detokenizer.recv_pyobj()
            for rid, text, finished in zip(out["rids"], out["texts"], out["finished"]):
                state = self.rid_to_state.get(rid)
                if state is None:  # the request was given up on
                    continue
                state.text += text
                if finished and not state.future.done():
                    state.future.set_result(state.text)

    def update_weights_forever(self) -> None:
        """blocked-loop: take the lock for a weight update whose acknowledgement never comes."""
        with self.model_update_lock:
            logger.info("Updating weights from disk")
            threading.Event().wait()


def build_app(manager: TokenizerManager, shape: str) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        manager.loop_kind = type(asyncio.get_running_loop()).__module__.split(".")[0]
        handle = asyncio.create_task(manager.handle_loop())
        if shape == "blocked-loop":
            threading.Thread(target=manager.update_weights_forever, name="update-weights").start()
        yield
        handle.cancel()

    app = FastAPI(lifespan=lifespan)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.post("/generate")
    async def generate(req: GenerateReqInput) -> dict[str, Any]:
        return await manager.generate(req)

    return app


# --- the announcer: when has the shape been reached? ------------------------------------------


class Announcer(threading.Thread):
    """Prints LISTENING, then READY once the shape holds, then exits (test plumbing only)."""

    STABLE_S = 0.2  # parked threads must stay parked, unmoved, this long

    def __init__(
        self,
        args: argparse.Namespace,
        server: uvicorn.Server,
        manager: TokenizerManager,
        status: Connection,
        scheduler_pid: int,
        detokenizer_pid: int,
    ) -> None:
        super().__init__(name="announcer", daemon=True)
        self.args, self.server, self.manager, self.status = args, server, manager, status
        self.pids = {"scheduler": scheduler_pid, "detokenizer": detokenizer_pid}
        self.statuses: dict[str, dict[str, Any]] = {}
        self.parked: tuple[object, float] | None = None  # (what futex_parked saw, since when)

    def run(self) -> None:
        while not self.server.started:
            time.sleep(0.02)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        print(f"LISTENING pid={os.getpid()} port={port}", flush=True)
        while (extra := self.reached(port)) is None:
            time.sleep(0.02)
        loop = self.manager.loop_kind
        words = " ".join(f"{k}={v}" for k, v in {**self.pids, "loop": loop, **extra}.items())
        print(f"READY shape={self.args.shape} pid={os.getpid()} port={port} {words}", flush=True)

    def reached(self, port: int) -> dict[str, Any] | None:
        while self.status.poll():
            msg = self.status.recv()
            if msg["status"] == "failed":
                print(f"FAILED scheduler: {msg['error']}", flush=True)
                os._exit(1)
            self.statuses[msg["status"]] = msg
        shape, m = self.args.shape, self.manager
        if shape == "loading":
            return {} if "loading" in self.statuses else None
        if shape == "idle":
            return {} if "ready" in self.statuses else None
        if shape == "serving":
            return {} if "ready" in self.statuses and m.answered >= 5 else None
        if shape == "blocked-loop":
            queued = listen_queue(port) or 0
            if queued < self.args.queued or not self.stably_parked(os.getpid(), [os.getpid()]):
                return None
            return {"queued": queued}
        hung = self.statuses.get("hung")
        if hung is None or not m.rid_to_state or (shape == "abba-retry" and m.received < 2):
            return None
        if "child" in hung:  # fork-lock: the helper's only thread is the one parked
            pid, tids = hung["child"], [hung["child"]]
        else:
            pid, tids = self.pids["scheduler"], [*hung["tids"], hung["joiner"]]
        if not self.stably_parked(pid, tids):
            return None
        extra = {k: ",".join(map(str, v)) if isinstance(v, list) else v for k, v in hung.items()}
        del extra["status"]
        if "words" in hung:
            extra["words"] = ",".join(hex(w) for w in hung["words"])
        return {**extra, "waiting": len(m.rid_to_state)}

    def stably_parked(self, pid: int, tids: list[int]) -> bool:
        seen, now = futex_parked(pid, tids), time.monotonic()
        if seen is None:
            self.parked = None
            return False
        if self.parked is None or self.parked[0] != seen:
            self.parked = (seen, now)
        return now - self.parked[1] >= self.STABLE_S


# --- the root process -------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", choices=SHAPES, required=True)
    p.add_argument("--port", type=int, default=0, help="HTTP port on 127.0.0.1 (0: any free one)")
    p.add_argument("--log", help="log file every process appends to (default: stderr)")
    p.add_argument("--run-dir", help="for the ipc:// sockets and weights (default: a new tmp dir)")
    p.add_argument("--weights", help="file:PATH or tcp:HOST:PORT (default: a new file)")
    p.add_argument("--weights-mib", type=int, default=8, help="size of the default weights file")
    p.add_argument("--log-every-mib", type=int, default=1, help="a loading progress line per N MiB")
    p.add_argument("--native-lib", help="libabba.so for native-abba (default: build abba.c)")
    p.add_argument("--backlog", type=int, default=2048, help="listen backlog (uvicorn's default)")
    p.add_argument("--queued", type=int, default=3, help="blocked-loop: READY at this accept queue")
    p.add_argument(
        "--watchdog-timeout", type=float, default=300, help="scheduler watchdog (0: off)"
    )
    args = p.parse_args(argv)
    if args.shape == "loading" and not args.weights:
        p.error("--shape loading needs --weights, e.g. tcp:HOST:PORT of a weight server")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup_logging(args.log, "frontend")
    run_dir = Path(args.run_dir or tempfile.mkdtemp(prefix="serving-"))
    weights = args.weights
    if weights is None:
        weights = f"file:{run_dir / 'weights.bin'}"
        (run_dir / "weights.bin").write_bytes(os.urandom(args.weights_mib << 20))
    native_lib = args.native_lib
    if native_lib is None and args.shape == "native-abba":
        from .native import build_abba

        native_lib = str(build_abba(run_dir))

    mp.set_start_method("spawn", force=True)
    ipc = IpcNames.under(run_dir)
    cfg = SchedulerConfig(
        args.shape, weights, args.log, native_lib, args.watchdog_timeout, args.log_every_mib
    )
    status_reader, status_writer = mp.Pipe(duplex=False)
    scheduler = mp.Process(
        target=run_scheduler_process, args=(cfg, ipc, status_writer), name="scheduler"
    )
    scheduler.start()
    detokenizer = mp.Process(
        target=run_detokenizer_process, args=(args.log, ipc), name="detokenizer"
    )
    detokenizer.start()

    manager = TokenizerManager(ipc)
    config = uvicorn.Config(
        build_app(manager, args.shape),
        host="127.0.0.1",
        port=args.port,
        backlog=args.backlog,
        log_config=None,  # uvicorn's loggers, access log included, go to our log
        log_level="info",
        timeout_keep_alive=5,  # SGLang's setting
    )
    server = uvicorn.Server(config)
    assert scheduler.pid is not None and detokenizer.pid is not None
    Announcer(args, server, manager, status_reader, scheduler.pid, detokenizer.pid).start()
    server.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
