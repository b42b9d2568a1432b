"""Whether an answer on a connection is finished, from how its last write ended.

tcp_info calls a connection answered when it sent last; a streamed answer (Server-Sent Events,
``"stream": true``) sends its headers and first events at once, so a generation that hangs
midway looks answered while its client waits. The write probe keeps the last 16 bytes of each
fd's last write (bpf/io.bpf.c), and the stream's framing says whether it ended or is still
being sent; any other ending is left to tcp_info (docs/how-it-works.md, "Front doors and work
waiting").
"""

from __future__ import annotations

# A stream that ended: the last chunk of a chunked body, or the OpenAI stream's end event.
_FINISHED = (b"\r\n0\r\n\r\n", b"[DONE]\n\n", b"[DONE]\n\n\r\n")
# One still being sent: an event that ended (inside its chunk or not) with no end after it, or
# the headers of a chunked or event-stream answer with no chunk yet. Any other ending (a
# Content-Length body, another kind of stream) is not read here: tcp_info decides.
_STREAMING = (b"\n\n", b"\n\n\r\n", b"chunked\r\n\r\n", b"event-stream\r\n\r\n")


def stream_in_flight(tail: bytes) -> bool:
    """The last write on a connection, ending in ``tail``, leaves a streamed answer unfinished."""
    if tail == b"0\r\n\r\n" or tail.endswith(_FINISHED):
        return False
    return tail.endswith(_STREAMING)
