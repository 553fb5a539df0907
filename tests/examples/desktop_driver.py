"""Drives examples/desktop_chat.py in a real X window; test_desktop_chat.py runs it under Xvfb.

    python tests/examples/desktop_driver.py MODEL.gguf SCREENSHOT.png   ->  one JSON line on stdout

Keys are typed and the Stop button clicked with xdotool (real X input events); the settings are set
through their widgets. Everything the driver does on the GUI thread is one short step scheduled with
after(), so the Tk loop stays as free as in the example alone. A heartbeat timer on the Tk loop
measures the GUI thread's longest stall while a 128-token reply streams in.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import threading
import time
import tkinter as tk
from pathlib import Path

import fastserve

REPO = Path(__file__).resolve().parents[2]
HEARTBEAT_MS = 5


def load_example():
    spec = importlib.util.spec_from_file_location("desktop_chat", REPO / "examples" / "desktop_chat.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class Heartbeat:
    """A timer on the Tk loop every HEARTBEAT_MS; the longest gap between two ticks is the worst stall."""

    def __init__(self, root):
        self.root, self.last, self.max_gap, self.on = root, None, 0.0, False
        self.long = []          # (seconds since start, gap ms) of gaps over 20 ms
        root.after(HEARTBEAT_MS, self._tick)

    def start(self):
        self.last, self.max_gap, self.on = time.perf_counter(), 0.0, True
        self.t0 = self.last

    def _tick(self):
        now = time.perf_counter()
        if self.on:
            self.max_gap = max(self.max_gap, now - self.last)
            if now - self.last > 0.02:
                self.long.append((round(now - self.t0, 3), round((now - self.last) * 1e3, 1)))
        self.last = now
        self.root.after(HEARTBEAT_MS, self._tick)


class SlotWatch:
    """A thread that looks at engine.snapshot every 0.5 ms (steps take ~10-30 ms on the default model) and
    keeps the first snapshot that shows no running request. Within one step of a cancel means: at most
    one more token generated (the step in flight), tokens_generated counting them (one slot, one request).
    Run only around a cancel, so that the stall measure is not disturbed."""

    def __init__(self, engine):
        self.engine, self.first_idle, self._on, self.at_cancel = engine, None, True, None
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()        # (start() waits for the thread: a step may pass; mark() comes after)

    def mark(self):
        """Call right before the cancel."""
        self.at_cancel = self.engine.snapshot

    def _watch(self):
        while self._on and self.at_cancel is None:
            time.sleep(0.0005)
        while self._on and self.first_idle is None:
            snap = self.engine.snapshot
            if snap.n_running == 0:
                self.first_idle = snap
            time.sleep(0.0005)

    def stop(self) -> dict | None:
        """{"tokens": generated after the cancel, "steps": published after it (idle ones included)}."""
        self._on = False
        self._thread.join()
        if self.first_idle is None:
            return None
        return {"tokens": self.first_idle.tokens_generated - self.at_cancel.tokens_generated,
                "steps": self.first_idle.step - self.at_cancel.step}


def run(model_path: str, shot: str) -> dict:
    ex = load_example()
    model = fastserve.load_model(model_path)
    engine = fastserve.Engine(model, n_parallel=1, n_ctx=2048, threads=ex.decode_threads())
    root = tk.Tk()
    win = ex.ChatWindow(root, engine, model.tokenizer)
    beat = Heartbeat(root)
    out: dict = {}
    watches: list = []
    # The snapshot at the cancel itself: the window's stop() (which its Stop button and its close() call)
    # starts a SlotWatch first. A separate binding would run in another Tcl -> Python callback, and a
    # step can pass while the GUI thread waits for the GIL between the two.
    example_stop = win.stop

    def watched_stop():
        watches.append(SlotWatch(engine))
        watches[-1].mark()
        example_stop()
    win.stop = watched_stop
    win.stop_button.configure(command=watched_stop)

    def set_spin(spin, value):
        spin.delete(0, "end")
        spin.insert(0, str(value))

    def xdotool(*args):
        return subprocess.Popen(["xdotool", *args])

    def type_prompt(text):
        win.entry.focus_force()
        # (`xdotool type` takes every argument after it as text: Return is a second command)
        return subprocess.Popen(["sh", "-c", 'xdotool type --delay 2 "$1" && xdotool key Return', "sh", text])

    t_wait: list = []

    def _after(seconds):
        """True once `seconds` have passed since its first call in a row of calls."""
        if not t_wait:
            t_wait.append(time.monotonic())
        if time.monotonic() - t_wait[0] >= seconds:
            t_wait.clear()
            return True
        return False

    def script():
        yield lambda: root.winfo_viewable()
        out["window"] = [root.winfo_width(), root.winfo_height()]

        # 0. A bad setting is refused in the window's status line, nothing sent, nothing lost.
        set_spin(win.max_tokens, "lots")
        win.entry.insert(0, "hello")
        win.send_button.invoke()
        out["refused"] = win.status.cget("text") if win.reader is None and win.entry.get() == "hello" else None
        win.entry.delete(0, "end")

        # 1. A 128-token greedy reply, typed into the entry; the heartbeat runs from the Return key on.
        set_spin(win.temperature, 0)
        set_spin(win.max_tokens, 128)
        typing = type_prompt("Tell me a story")
        yield lambda: win.reader is not None or typing.poll() is not None
        yield lambda: win.reader is not None or _after(0.5)       # typed: Return has reached the window
        assert win.reader is not None, f"the typed prompt was not sent (the entry holds {win.entry.get()!r})"
        beat.start()
        yield lambda: win.reader is None
        beat.on = False
        out["max_stall_ms"] = beat.max_gap * 1e3
        out["long_gaps"] = beat.long
        out["reply"] = win.history[-1]["content"]
        out["stats"] = win.last_stats
        root.update_idletasks()
        from PIL import ImageGrab
        x, y = root.winfo_rootx(), root.winfo_rooty()
        ImageGrab.grab(bbox=(x, y, x + root.winfo_width(), y + root.winfo_height()),
                       xdisplay=os.environ["DISPLAY"]).save(shot)

        # 2. Stop mid-reply, clicked with the mouse.
        set_spin(win.max_tokens, 1000)
        typing = type_prompt("Write a long poem about the sea")
        yield lambda: win.reader is not None and len(win.reply) >= 5
        bx = win.stop_button.winfo_rootx() + win.stop_button.winfo_width() // 2
        by = win.stop_button.winfo_rooty() + win.stop_button.winfo_height() // 2
        xdotool("mousemove", str(bx), str(by), "click", "1")
        yield lambda: watches and watches[0].first_idle is not None or _after(5)
        out["after_stop"] = watches[0].stop() if watches else "the click did not reach the Stop button"
        yield lambda: win.reader is None
        out["stop_stats"] = win.last_stats

        # 3. Close the window mid-reply, as a window manager does (the WM_DELETE_WINDOW protocol).
        typing = type_prompt("Tell me about the moon")
        yield lambda: win.reader is not None and len(win.reply) >= 5
        out["closed"] = True
        watches.clear()
        root.tk.call(root.protocol("WM_DELETE_WINDOW"))     # ChatWindow.close(): stop(), then destroy

    steps = script()

    def advance(pred=None):
        try:
            if pred is None or pred():
                pred = next(steps)
        except StopIteration:
            return
        except Exception as exc:            # report it, and leave the loop
            out["error"] = f"{type(exc).__name__}: {exc}"
            root.destroy()
            return
        root.after(10, advance, pred)

    root.after(0, advance)
    root.after(60_000, root.destroy)        # whatever happens, the loop ends
    root.mainloop()
    if out.get("closed"):                   # the window is gone: its reply's slot must be free
        deadline = time.monotonic() + 5
        while watches and watches[0].first_idle is None and time.monotonic() < deadline:
            time.sleep(0.002)
        out["after_close"] = watches[0].stop() if watches else "closing the window did not stop the reply"
    engine.close()
    return out


if __name__ == "__main__":
    print(json.dumps(run(sys.argv[1], sys.argv[2])))
