"""Whether an answer on a connection is finished, from how its last write ended.

tcp_info says whether a connection received a request after it last sent (agent.analysis.classify,
waiting_for_answer). A streaming answer defeats that: an OpenAI-compatible server answers
``"stream": true`` with Server-Sent Events, so it sends the headers and the first events
right after the request, and if the engine then hangs mid-generation the connection has sent
last and looks answered while its client waits forever. The write probe keeps the last 16
bytes of each fd's last write (bpf/io.bpf.c), and an SSE answer's framing says whether it is
done:

* finished: the last chunk of a chunked body (``0\\r\\n\\r\\n``), or the OpenAI stream's end
  event (``data: [DONE]\\n\\n``);
* still being sent: an event that ended (``\\n\\n``, inside its chunk ``\\n\\n\\r\\n``) with no end
  after it, or the headers of a chunked or ``text/event-stream`` answer with no chunk yet;
* anything else (a ``Content-Length`` body, a chunk of some other stream): not a stream
  hangwatch can read, so left to tcp_info.

What stays unseen: TLS on the wire (the bytes are ciphertext), HTTP/2 and gRPC streams (binary
frames), and answers written by sendfile or splice (no buffer to read).

The other side, a request not finished by its client, is told by no bytes at all: a thread
of the server blocked reading that connection with nothing left unread (classify.client_turn,
docs/how-it-works.md).
"""

from __future__ import annotations

_FINISHED = (b"\r\n0\r\n\r\n", b"[DONE]\n\n", b"[DONE]\n\n\r\n")
_STREAMING = (b"\n\n", b"\n\n\r\n", b"chunked\r\n\r\n", b"event-stream\r\n\r\n")


def stream_in_flight(tail: bytes) -> bool:
    """The last write on a connection, ending in ``tail``, leaves a streamed answer unfinished."""
    if tail == b"0\r\n\r\n" or tail.endswith(_FINISHED):
        return False
    return tail.endswith(_STREAMING)
