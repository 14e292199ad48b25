"""A wake-up line from rank 0 to the other ranks, beside the ring.

MLX's ring backend waits for a collective by polling its socket: a rank waiting for
rank 0's next plan keeps a core busy for as long as rank 0 has none (an idle server,
or rank 0 scoring with the draft, which the other ranks do not hold). So rank 0 rings
a TCP doorbell, one byte per plan, and the other ranks block on it before they enter
the plan's collective: waiting costs them nothing.

Set up once, at the first plan, by every rank in the same order: rank 0 listens on its
own ring address (from `MLX_HOSTFILE`) and sends the port and a random token through
one `all_sum`; each other rank connects and sends the token and its rank back; then
every rank says whether it succeeded (`agree`). Where any rank failed (no hostfile, a
port that cannot be reached) there is no doorbell and the ranks wait in the collective
as before. A doorbell that closes (rank 0 exited) ends the waiting rank's loop with an
error, as a broken ring does.
"""

import json
import logging
import os
import secrets
import socket
from typing import Optional

import mlx.core as mx

logger = logging.getLogger(__name__)
SETUP_TIMEOUT = 10.0  # seconds to connect or to accept every rank


def _rank0_address() -> Optional[str]:
    """Rank 0's address in the ring's host file, or None without one."""
    try:
        with open(os.environ["MLX_HOSTFILE"]) as f:
            hosts = json.load(f)
        return str(hosts[0][0]).rsplit(":", 1)[0]
    except (KeyError, OSError, ValueError, IndexError, TypeError):
        return None


class Doorbell:
    """Rank 0 rings (`ring`); the other ranks wait for it (`wait`). Where it could not
    be set up on every rank it holds no connection, and neither does anything."""

    def __init__(self, group, agree):
        self.group, self.rank = group, group.rank()
        self.sockets: list = []  # rank 0: one per other rank; others: the one to rank 0
        failed, listener, token = False, None, [0, 0]
        if self.rank == 0:
            address = _rank0_address()
            try:
                if address is None:
                    raise OSError("no MLX_HOSTFILE")
                listener = socket.create_server((address, 0))
                port = listener.getsockname()[1]
                token = [secrets.randbelow(2**31), secrets.randbelow(2**31)]
            except OSError as error:
                logger.info("no doorbell: %s; the ranks wait for plans in the ring", error)
                failed, port = True, 0
            sent = [port, *token]
        else:
            address, sent = _rank0_address(), [0, 0, 0]
        port, *token = (int(v) for v in mx.distributed.all_sum(
            mx.array(sent, dtype=mx.int32), group=group).tolist())
        try:
            if port == 0:
                failed = True
            elif self.rank == 0:
                self._accept(listener, token)
            else:
                self._connect(address, port, token)
        except (OSError, ValueError) as error:
            logger.info("rank %d: no doorbell: %r; the ranks wait for plans in the ring",
                        self.rank, error)
            failed = True
        finally:
            if listener is not None:
                listener.close()
        if agree(group, failed):
            self.close()

    def _accept(self, listener, token: list) -> None:
        listener.settimeout(SETUP_TIMEOUT)
        expected = set(range(1, self.group.size()))
        while expected:
            connection, _ = listener.accept()
            connection.settimeout(SETUP_TIMEOUT)
            words = _read(connection, 12)
            rank = int.from_bytes(words[8:], "little")
            if [int.from_bytes(words[:4], "little"), int.from_bytes(words[4:8], "little")] \
                    != token or rank not in expected:
                connection.close()  # not one of the ranks: never read again
                continue
            connection.settimeout(None)
            expected.discard(rank)
            self.sockets.append(connection)

    def _connect(self, address: Optional[str], port: int, token: list) -> None:
        if address is None:
            raise OSError("no MLX_HOSTFILE")
        connection = socket.create_connection((address, port), timeout=SETUP_TIMEOUT)
        connection.sendall(b"".join(v.to_bytes(4, "little") for v in (*token, self.rank)))
        connection.settimeout(None)
        self.sockets.append(connection)

    def ring(self) -> None:
        """Rank 0: a plan follows. ConnectionError where a rank has gone."""
        for connection in self.sockets:
            try:
                connection.sendall(b"\x01")
            except OSError as error:
                raise ConnectionError(f"the connection to a rank was lost (its doorbell: "
                                      f"{error})") from error

    def wait(self) -> None:
        """Another rank: block until rank 0 rings; ConnectionError once it has gone."""
        if self.sockets and not self.sockets[0].recv(1):
            raise ConnectionError("rank 0 closed the doorbell: it has exited")

    def close(self) -> None:
        for connection in self.sockets:
            connection.close()
        self.sockets = []


def _read(connection, size: int) -> bytes:
    data = b""
    while len(data) < size:
        part = connection.recv(size - len(data))
        if not part:
            raise OSError("a connection closed during the doorbell's setup")
        data += part
    return data
