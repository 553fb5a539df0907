"""examples/desktop_chat.py in a real X window (Xvfb), on the default model: a prompt typed into the
window gets a streamed 128-token reply while the GUI thread never stalls more than 50 ms (a 5 ms timer on
the Tk loop); Stop and closing the window free the slot within one step; a screenshot of the window is
kept as a test artifact (build/test-artifacts/desktop_chat.png).

Needs Debian's xvfb (xvfb-run) and xdotool, which `make test` installs where it can; skips without them.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from ..artifacts import REPO_ROOT, artifact_dir, image_spread

MAX_STALL_MS = 50


def _drive(model_file: str, shot) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(["xvfb-run", "-a", "-s", "-screen 0 1024x768x24", sys.executable,
                           str(REPO_ROOT / "tests" / "examples" / "desktop_driver.py"), model_file, str(shot)],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "error" not in out, out
    return out


@pytest.mark.model
def test_desktop_chat_under_xvfb(default_model_file):
    missing = [tool for tool in ("xvfb-run", "xdotool") if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"{', '.join(missing)} not installed (apt-get install xvfb xdotool; make test does it where it can)")
    pytest.importorskip("tkinter", reason="this Python has no tkinter (Debian: python3-tk)")
    shot = artifact_dir() / "desktop_chat.png"
    shot.unlink(missing_ok=True)
    out = _drive(default_model_file, shot)
    if out.get("max_stall_ms", 0) > MAX_STALL_MS and os.getloadavg()[0] > os.cpu_count():
        # Other processes keep more threads runnable than there are cores: one OS scheduling delay of the
        # GUI thread looks like a stall. Measure once more, and judge that run (both are reported).
        first = out["max_stall_ms"]
        out = _drive(default_model_file, shot)
        out["long_gaps"] = f"{out['long_gaps']} (a first run under load stalled {first:.0f} ms)"

    assert out["refused"] and out["refused"].startswith("not sent: "), out["refused"]
    # The typed prompt got a streamed reply of 128 tokens, and the window said how fast.
    assert out["reply"].strip(), out
    assert out["stats"].startswith("128 tokens · ") and "tokens/s" in out["stats"], out["stats"]
    assert out["max_stall_ms"] <= MAX_STALL_MS, (
        f"the GUI thread stalled {out['max_stall_ms']:.0f} ms during the reply; gaps over 20 ms "
        f"(s after send, ms): {out['long_gaps']}; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")

    # Stop (a mouse click) and closing the window: the cancelled reply computed at most the step in flight.
    assert isinstance(out["after_stop"], dict) and out["after_stop"]["tokens"] <= 1, out["after_stop"]
    assert out["stop_stats"].endswith("stopped"), out["stop_stats"]
    assert out.get("closed") and isinstance(out["after_close"], dict), out
    assert out["after_close"]["tokens"] <= 1, out["after_close"]

    spread, colours = image_spread(shot)
    assert spread > 10 and colours > 20, f"the window's screenshot looks blank ({spread=:.1f}, {colours=})"
