"""How the last bytes written on a connection tell a streamed answer still being sent."""

from __future__ import annotations

from agent.analysis.answers import stream_in_flight

# What uvicorn (h11) writes for a FastAPI StreamingResponse of Server-Sent Events, as the
# write probe keeps it: the last 16 bytes of each write.
HEADERS = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
)
EVENT = b'6b\r\ndata: {"id":"cmpl-1","choices":[{"text":" the"}]}\n\n\r\n'
DONE = b"e\r\ndata: [DONE]\n\n\r\n"
LAST_CHUNK = b"0\r\n\r\n"


def tail(write: bytes) -> bytes:
    return write[-16:]


def test_a_stream_is_in_flight_from_its_headers_to_its_last_chunk():
    assert stream_in_flight(tail(HEADERS))  # headers sent, no event yet
    assert stream_in_flight(tail(EVENT))  # an event, more to come
    assert not stream_in_flight(tail(DONE))  # the OpenAI stream's end event
    assert not stream_in_flight(tail(LAST_CHUNK))  # the chunked body's end
    assert not stream_in_flight(tail(b"data: x\n\n" + LAST_CHUNK))  # both in one write
    assert stream_in_flight(tail(b"data: token\n\n"))  # SSE without chunking


def test_answers_that_are_not_streams_are_left_to_tcp_info():
    json_body = b'{"id":"cmpl-1","choices":[{"text":"hello"}]}'
    plain = b"HTTP/1.1 200 OK\r\ncontent-length: 3\r\n\r\n"
    for write in (json_body, b"ok\n", plain, b"", b"0\r\n", b"\r\n"):
        assert not stream_in_flight(tail(write)), write
