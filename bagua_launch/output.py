"""What the launcher prints: every rank's lines as they come, and a summary when a job ends badly.

Both modes use it: the supervisor of local and MPI ranks, and the elastic agent's wrapper,
so an exit status reads the same (``exit code 3``, ``killed by SIGTERM``) whichever ran the job.
"""

from __future__ import annotations

import collections
import re
import signal
import sys
import threading
from collections.abc import Sequence
from typing import IO

NAME = "bagua-launch"
_PREFIX_RE = re.compile(rb"^\[rank (\d+)\] ")


class RankOutput:
    """The launcher's stdout and stderr, shared by the reader threads (whole lines, flushed)."""

    def __init__(self, tail_lines: int = 0) -> None:
        self.lock = threading.Lock()
        self.streams = {"stdout": sys.stdout, "stderr": sys.stderr}
        self.broken: set[str] = set()
        self.tail_lines = tail_lines
        self.tails: dict[object, collections.deque] = {}  # rank (or "mpiexec") -> its last lines

    def write(self, which: str, data: bytes) -> None:
        """Write ``data`` (whole lines) to ``which``, ``stdout`` or ``stderr``; a closed stream is skipped."""
        stream = self.streams[which]
        with self.lock:
            if which in self.broken:
                return
            try:
                buffer = getattr(stream, "buffer", None)
                if buffer is not None:
                    buffer.write(data)
                else:
                    stream.write(data.decode(errors="replace"))
                stream.flush()
            except (BrokenPipeError, ValueError, OSError):
                self.broken.add(which)  # keep draining the ranks' pipes; nothing to print to

    def message(self, text: str) -> None:
        """The launcher's own message, on stderr."""
        self.write("stderr", text.encode())

    def relay(self, pipe: IO[bytes], which: str, rank: int | None, label: str) -> None:
        """Print every line of a child's ``pipe`` until it closes, keeping each rank's last lines.

        A rank's lines get the prefix ``[rank N]``; ``mpiexec``'s (``rank`` None) already carry
        it from the ``rank_env`` wrappers, and a line without one is kept under ``label``.
        """
        prefix = None if rank is None else f"[rank {rank}] ".encode()
        try:
            for line in iter(pipe.readline, b""):
                if not line.endswith(b"\n"):
                    line += b"\n"
                if prefix is not None:
                    line = prefix + line
                    key: object = rank
                else:  # mpiexec's output: the rank_env wrappers already prefixed their lines
                    match = _PREFIX_RE.match(line)
                    key = int(match.group(1)) if match else label
                self.write(which, line)
                tail = self.tails.get(key)
                if tail is None:  # setdefault: atomic, the stdout and stderr readers may race here
                    tail = self.tails.setdefault(key, collections.deque(maxlen=max(self.tail_lines, 1)))
                tail.append(line.decode(errors="replace").rstrip("\r\n"))
        except (OSError, ValueError):
            pass
        finally:
            try:
                pipe.close()
            except OSError:
                pass

    def last_lines(self, key: object) -> list[str]:
        """The last ``tail_lines`` lines of a rank (or of ``mpiexec``), oldest first."""
        tail = self.tails.get(key)
        return list(tail)[-self.tail_lines :] if tail and self.tail_lines else []


def signal_name(signum: int) -> str:
    """``SIGTERM`` for 15; ``signal N`` for a number without a name."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def describe_exit(code: int | None) -> str:
    """A return code in words: ``exit code N``, ``killed by SIGNAME`` (negative codes) or gone without one."""
    if code is None:
        return "gone without an exit status"
    if code < 0:
        return f"killed by {signal_name(-code)}"
    return f"exit code {code}"


def exit_status(code: int) -> int:
    """A rank's return code as a shell exit status (128 + N for signal N)."""
    return 128 - code if code < 0 else code


def rank_ranges(ranks: Sequence[int]) -> str:
    """Ranks as ranges: ``0-3, 5``."""
    ranks = sorted(ranks)
    parts, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            parts.append(str(start) if start == r else f"{start}-{r}")
            start = None
    return ", ".join(parts)


def summary(headline: str, status_lines: Sequence[str], tail_name: str = "", tail: Sequence[str] = ()) -> str:
    """The framed report of a job that ended badly: a headline, one line per status, then ``tail_name``'s last lines."""
    lines = ["", f"==================== {NAME}: {headline} ====================", *status_lines]
    if tail:
        lines.append(f"-------------------- last lines of {tail_name} --------------------")
        lines.extend(tail)
    lines.append("=" * len(lines[1]))
    return "\n".join(lines) + "\n"
