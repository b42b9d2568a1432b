"""The detokenizer process, shaped like SGLang's ``DetokenizerManager``: a blocking
``recv_pyobj()`` from the scheduler, token ids to text, ``send_pyobj()`` to the front-end."""

from __future__ import annotations

import logging
from typing import Any

import zmq

from .common import IpcNames, get_zmq_socket, setup_logging

logger = logging.getLogger("detokenizer")


class DetokenizerManager:
    def __init__(self, ipc: IpcNames) -> None:
        context = zmq.Context(2)
        self.recv_from_scheduler = get_zmq_socket(context, zmq.PULL, ipc.detokenizer, True)
        self.send_to_tokenizer = get_zmq_socket(context, zmq.PUSH, ipc.tokenizer, False)

    def event_loop(self) -> None:
        while True:
            batch: dict[str, Any] = self.recv_from_scheduler.recv_pyobj()
            texts = [chr(ord("a") + token % 26) for token in batch["token_ids"]]
            self.send_to_tokenizer.send_pyobj(
                {"rids": batch["rids"], "texts": texts, "finished": batch["finished"]}
            )


def run_detokenizer_process(log: str | None, ipc: IpcNames) -> None:
    setup_logging(log, "detokenizer")
    DetokenizerManager(ipc).event_loop()
