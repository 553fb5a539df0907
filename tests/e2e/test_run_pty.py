"""`fastserve run` under a pseudo-terminal, as a user types: a two-turn chat, a reply stopped by Ctrl-C (the
chat goes on), Ctrl-C at the prompt, /bye and Ctrl-D; a bad model says why. The tiny model (random weights)
answers greedily: its replies are compared with the engine's own for the same conversation."""
from __future__ import annotations

import os
import pty
import select
import signal
import sys
import time

import pytest

import fastserve
from fastserve.terminal_chat import TerminalChat

from .conftest import REPO_ROOT


class Terminal:
    """`fastserve run ARGS` on a pty: send keys, read what the screen shows."""

    def __init__(self, *args: str):
        env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), TERM="dumb")
        self.pid, self.fd = pty.fork()
        if self.pid == 0:                     # the child: the pty is its controlling terminal
            os.chdir(REPO_ROOT)
            # a person's terminal delivers Ctrl-C: undo an ignored or blocked SIGINT inherited from the test process
            # (make test's serial phase from a fresh clone had one: every Ctrl-C of these tests was lost)
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])
            os.execve(sys.executable, [sys.executable, "-m", "fastserve", "run", *args], env)
        self.seen = ""

    def read_until(self, marker: str, timeout: float = 60.0) -> str:
        """What came after the last read up to and including marker."""
        deadline = time.monotonic() + timeout
        while marker not in self.seen:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.fd], [], [], left)[0]:
                raise AssertionError(f"no {marker!r} within {timeout} s; the screen:\n{self.seen[-2000:]}")
            try:
                self.seen += os.read(self.fd, 65536).decode("utf-8", "replace")
            except OSError:                   # the child is gone
                raise AssertionError(f"the program ended before {marker!r}; the screen:\n{self.seen[-2000:]}")
        head, _, self.seen = self.seen.partition(marker)
        return head + marker

    def send(self, keys: str) -> None:
        os.write(self.fd, keys.encode())

    def exit_code(self, timeout: float = 20.0) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                os.read(self.fd, 65536)       # drain, so the child never blocks on a full pty
            except OSError:
                pass
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                os.close(self.fd)
                return os.waitstatus_to_exitcode(status)
            time.sleep(0.05)
        os.kill(self.pid, 9)
        raise AssertionError("the program did not exit")


def _expected(model, turns: list[str], n: int) -> list[str]:
    """The engine's greedy replies to these turns, in-process, through the same conversation."""
    replies = []

    def write(text):
        replies[-1] += text
    with fastserve.Engine(model, n_parallel=1, n_ctx=4096, threads=1) as engine:
        chat = TerminalChat(engine, model.tokenizer, write=write, max_tokens=n, temperature=0)
        for t in turns:
            replies.append("")
            chat.reply(t)
    return [r[:-2] for r in replies]          # without the blank line after each reply


def _screen(text: str) -> str:
    return text.replace("\r\n", "\n")


def test_two_turns_an_interrupted_reply_and_exit(tiny_model_path, tiny_model):
    term = Terminal(tiny_model_path, "--temp", "0", "-n", "24", "-c", "4096", "-t", "1")
    term.read_until(">>> ")
    turns = ["hello there", "and then?"]
    want = _expected(tiny_model, turns, 24)
    for turn, reply in zip(turns, want):
        term.send(turn + "\r")
        shown = _screen(term.read_until(">>> "))
        assert shown.startswith(turn + "\n") and reply.strip()[:12] in shown, (shown, reply)
    term.send("/?\r")
    assert "/bye" in term.read_until(">>> ")
    time.sleep(0.5)         # a person's pause: a SIGINT in the microseconds before readline waits is seen only
    term.send("\x03")      # at the next key (CPython's readline), so this Ctrl-C comes once the prompt waits
    assert "Ctrl-D or /bye" in term.read_until(">>> ")        # a hint, not an exit
    term.send("/bye\r")
    assert term.exit_code() == 0


def test_ctrl_c_stops_a_reply_and_the_chat_goes_on(tiny_model_path, tiny_model):
    n = 4000                                   # the whole reply takes seconds; Ctrl-C comes after its first piece
    full = _expected(tiny_model, ["tell me a long story"], n)[0]
    term = Terminal(tiny_model_path, "--temp", "0", "-n", str(n), "-c", "4096", "-t", "1")
    term.read_until(">>> ")
    term.send("tell me a long story\r")
    term.read_until("tell me a long story")
    term.read_until(full[:6])                  # the reply has begun
    term.send("\x03")
    cut = _screen(term.read_until(">>> ", timeout=30))
    assert len(cut) < 0.5 * len(full) and "Ctrl-D or /bye" not in cut, (len(cut), len(full), cut[-200:])
    term.send("/clear\r")
    assert "Cleared" in term.read_until(">>> ")
    term.send("hello there\r")
    assert _screen(term.read_until(">>> ")).strip()
    term.send("\x04")                          # Ctrl-D: leave
    assert term.exit_code() == 0


@pytest.mark.parametrize("name, says", [("/nonexistent/model.gguf", "no such file: /nonexistent/model.gguf"),
                                        ("llama-9000", "neither a file nor a model fastserve can pull")])
def test_a_bad_model_says_why(name, says):
    term = Terminal(name)
    out = term.read_until("fastserve: error:") + term.read_until("\n")
    assert says in out + term.seen or says in _screen(out), out
    assert term.exit_code() == 1


def test_a_file_that_is_not_a_model_says_why(tmp_path):
    bad = tmp_path / "notes.gguf"
    bad.write_bytes(b"hello, not a model")
    term = Terminal(str(bad))
    out = term.read_until("fastserve: error:") + term.read_until("\n")
    assert "notes.gguf" in out and "Traceback" not in out
    assert term.exit_code() == 1
