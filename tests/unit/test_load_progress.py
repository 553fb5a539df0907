"""The load's progress bar (issue 14: tqdm instead of a hand-written one): shown on a terminal, and not
even imported when stderr is a file or a pipe (a server started by a script pays nothing for it)."""
from __future__ import annotations

import fcntl
import os
import pty
import select
import struct
import subprocess
import sys
import termios
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
LOAD = ("import sys, fastserve; fastserve.load_model(sys.argv[1]); "
        "print('tqdm imported:', 'tqdm' in sys.modules, file=sys.stderr)")


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}


def test_bar_on_a_terminal(tiny_model_path):
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))   # a terminal 100 wide
    p = subprocess.Popen([sys.executable, "-c", LOAD, tiny_model_path], stdin=slave, stdout=slave, stderr=slave,
                         env=_env())
    os.close(slave)
    out = b""
    while select.select([master], [], [], 30)[0]:
        try:
            chunk = os.read(master, 65536)
        except OSError:                # the child closed the terminal
            break
        if not chunk:
            break
        out += chunk
    assert p.wait(30) == 0, out
    text = out.decode("utf-8", "replace")
    assert "loading weights" in text and "100%" in text and "3/3" in text, text   # 2 layers + the rest
    assert "tqdm imported: True" in text


def test_no_bar_and_no_tqdm_when_stderr_is_a_pipe(tiny_model_path):
    p = subprocess.run([sys.executable, "-c", LOAD, tiny_model_path], capture_output=True, text=True, env=_env(),
                       timeout=60)
    assert p.returncode == 0, p.stderr
    assert "loading weights" not in p.stderr and "tqdm imported: False" in p.stderr, p.stderr
