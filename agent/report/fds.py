"""The fds a blocked thread waits on (agent.model.FdWait, read by agent.observe.fdwaits), in
words: "a socket to 10.0.0.2:5000 (fd 7), the listening socket on port 8000 (fd 5)"."""

from __future__ import annotations

from ..model import FdLink, FdWait, SocketPeer


def peer_words(peer: SocketPeer) -> str:
    if peer.kind == "listening":
        return f"the listening socket on port {peer.port}"
    if peer.kind == "unix":
        return f"the unix socket {peer.path}"
    return f"a socket to {peer.address}:{peer.port}"


def fd_words(link: FdLink) -> str:
    """One fd: a socket by its peer where its namespace's tables knew it, else by its name."""
    return f"{peer_words(link.peer)} (fd {link.fd})" if link.peer is not None else link.name


def fds_words(wait: FdWait) -> str:
    more = f" and {wait.more} more fds" if wait.more else ""
    return ", ".join(fd_words(x) for x in wait.fds) + more
