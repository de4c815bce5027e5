"""The nodes' password: read once, kept in memory, handed only to who needs it.

Never on a command line, in an environment, a log or a file we write. ssh gets it through
``SSH_ASKPASS``: a tiny helper program (no secret in it) that asks this process over a unix
socket in a private (0700) directory; the socket answers only processes of our own user. sudo on
a node gets it on its stdin, through the setup channel (encrypted by ssh).
"""

from __future__ import annotations

import os
import shutil
import socket
import stat
import struct
import sys
import tempfile
import threading
from pathlib import Path

from ptcluster.errors import UsageError


class Secret:
    """A password that does not print itself."""

    def __init__(self, value: str) -> None:
        self._value = value

    def reveal(self) -> str:
        return self._value

    def __repr__(self) -> str:
        return "Secret(***)"

    __str__ = __repr__


def read_password_file(path: str) -> Secret:
    """The first line of ``path``; refused when group or others may read it."""
    try:
        st = os.stat(path)
    except OSError as exc:
        raise UsageError(f"--password-file {path}: {exc.strerror}",
                         "give a file that exists (mode 600)") from None
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise UsageError(f"--password-file {path} is readable by group or others "
                         f"(mode {stat.S_IMODE(st.st_mode):o})", f"chmod 600 {path}")
    with open(path) as f:
        line = f.readline().rstrip("\r\n")
    if not line:
        raise UsageError(f"--password-file {path} is empty", "put the password on its first line")
    return Secret(line)


_HELPER = """#!{python}
import os, socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect(os.environ["PTCLUSTER_ASKPASS_SOCK"])
data = b""
while True:
    chunk = s.recv(4096)
    if not chunk:
        break
    data += chunk
sys.stdout.write(data.decode() + "\\n")
"""


class Askpass:
    """An ``SSH_ASKPASS`` helper and the socket that answers it, for the life of a setup run."""

    def __init__(self, secret: Secret) -> None:
        self.secret = secret
        self.dir = Path(tempfile.mkdtemp(prefix="ptcluster-askpass-"))  # mode 0700
        self.sock_path = str(self.dir / "s")
        self.helper = self.dir / "askpass"
        self.helper.write_text(_HELPER.format(python=sys.executable))
        os.chmod(self.helper, 0o700)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(self.sock_path)
        os.chmod(self.sock_path, 0o600)
        self._sock.listen(16)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="askpass", daemon=True)
        self._thread.start()

    def env(self) -> dict[str, str]:
        """What an ssh that may ask for the password needs in its environment."""
        return {**os.environ, "SSH_ASKPASS": str(self.helper), "SSH_ASKPASS_REQUIRE": "force",
                "PTCLUSTER_ASKPASS_SOCK": self.sock_path, "DISPLAY": os.environ.get(
                    "DISPLAY", ":0")}

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            with conn:
                creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                        struct.calcsize("3i"))
                _pid, uid, _gid = struct.unpack("3i", creds)
                if uid == os.getuid():
                    conn.sendall(self.secret.reveal().encode())

    def close(self) -> None:
        self._stop.set()
        try:
            # close() alone does not wake an accept() blocked in another thread on Linux:
            # shutdown() does, so the answering thread ends with the run
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        try:
            self._sock.close()
        except OSError:
            pass
        self._thread.join(timeout=5)
        shutil.rmtree(self.dir, ignore_errors=True)
