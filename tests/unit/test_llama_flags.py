"""llama-server's flags on `fastserve serve` (issue 14): the table covers every flag of llama-server's --help,
docs/flags.md shows that table, and every flag fastserve registers is honoured or refused with a reason."""
from __future__ import annotations

import argparse
import re
import subprocess
from pathlib import Path

import pytest

from fastserve.server import llama_flags
from fastserve.server.llama_flags import DIFFERS, FLAGS, REFUSED, SAME, covers

ROOT = Path(__file__).resolve().parents[2]
HELP_FLAGS = Path(__file__).parent / "data" / "llama_server_flags.txt"
LLAMA_SERVER = Path("/work/llama-peer/build/bin/llama-server")     # present on the development machines only
SPECULATIVE_ROW = covers("--spec-draft-threads")    # the draft model's settings, and the rest of the section


def _help_options(text: str) -> list[tuple[str, str]]:
    """(section, option) of each option llama-server's --help lists."""
    out, section = [], None
    for line in text.splitlines():
        m = re.match(r"----- (.*) params -----", line)
        if m:
            section = m.group(1)
        elif line.startswith("-"):
            for part in re.split(r"\s{2,}", line)[0].split(","):
                word = part.strip().split(" ")[0]
                if word.startswith("-"):
                    out.append((section, word))
    return out


def _recorded() -> list[tuple[str, str]]:
    return [tuple(line.split("\t")) for line in HELP_FLAGS.read_text().splitlines() if not line.startswith("#")]


def test_every_llama_server_flag_has_a_row():
    missing = []
    for section, option in _recorded():
        row = covers(option)
        if section == "speculative":
            row = row or SPECULATIVE_ROW
        if row is None:
            missing.append(option)
    assert not missing, f"llama-server flags without a row in fastserve/server/llama_flags.py: {missing}"
    assert len(_recorded()) > 300


@pytest.mark.skipif(not LLAMA_SERVER.exists(), reason="llama-server is not built here (/work/llama-peer)")
def test_the_recorded_flags_are_llama_servers():
    text = subprocess.run([str(LLAMA_SERVER), "--help"], capture_output=True, text=True, timeout=60).stdout
    assert _help_options(text) == _recorded()


def test_docs_show_the_table():
    assert llama_flags.markdown_table() in (ROOT / "docs" / "flags.md").read_text(), (
        "docs/flags.md is not FLAGS' table: replace its table with llama_flags.markdown_table()'s output")


def _serve_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    llama_flags.add_taken(p)
    llama_flags.add_refused(p)
    return p


def test_registered_flags_have_the_right_rows():
    p = _serve_parser()
    for action in p._actions:
        for option in action.option_strings:
            if option in ("-h", "--help"):
                continue
            row = covers(option)
            assert row is not None, option
            if isinstance(action, llama_flags._Refuse):
                assert row[1] in (REFUSED, DIFFERS), (option, row)
            else:
                assert row[1] in (SAME, DIFFERS), (option, row)


def test_a_refused_flag_exits_with_its_reason(capsys):
    with pytest.raises(SystemExit) as e:
        _serve_parser().parse_args(["--mlock"])
    assert e.value.code == 2
    assert "--mlock (llama-server's) is not supported by fastserve: the model is not locked in RAM" in \
        capsys.readouterr().err


def _fastserve_serve_parser() -> argparse.ArgumentParser:
    """`fastserve serve`'s own parser, as cli.main builds it (caught at parse time)."""
    from fastserve import cli
    captured = {}

    def keep(self, argv=None, namespace=None):
        captured["parser"] = self
        raise SystemExit(0)

    orig = argparse.ArgumentParser.parse_args
    argparse.ArgumentParser.parse_args = keep
    try:
        with pytest.raises(SystemExit):
            cli.main(["serve"])
    finally:
        argparse.ArgumentParser.parse_args = orig
    sub = next(a for a in captured["parser"]._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["serve"]


def test_rows_that_say_taken_are_taken():
    """A flag of a row that says same (or differs, unless its note says it is refused) is accepted by
    `fastserve serve`'s parser, not refused and not unknown."""
    options = {o: a for a in _fastserve_serve_parser()._actions for o in a.option_strings}
    for flags, status, note in FLAGS:
        for name in llama_flags._names(flags):
            if "*" in name or status == REFUSED:
                continue
            action = options.get(name)
            if status == SAME:
                assert action is not None and not isinstance(action, llama_flags._Refuse), name
            elif action is None or isinstance(action, llama_flags._Refuse):
                assert "refused" in note, (name, note)


def test_resolve_maps_the_flags():
    parse = _fastserve_serve_parser().parse_args
    r = llama_flags.resolve(parse(["-b", "256", "-ub", "64", "--temp", "0", "--top-k", "5", "-s", "9",
                                   "--device", "cuda", "-ngl", "0", "-lv", "2"]))
    assert r["n_batch"] == 64 and r["device"] == "cpu" and r["seed"] == 9 and not r["log_requests"]
    assert r["sampling"] == {"temperature": 0.0, "top_k": 5} and r["ignore_eos"] is False
    assert llama_flags.resolve(parse(["--ignore-eos"]))["ignore_eos"] is True
    r = llama_flags.resolve(parse(["-ub", "1024", "-ngl", "all", "--seed", "-1", "-v"]))
    assert r["n_batch"] == 512 and r["n_gpu_layers"] == "all" and r["seed"] is None and r["log_requests"]
    assert llama_flags.resolve(parse(["--chat-template", "chatml"]))["chat_template"] == \
        llama_flags.BUILTIN_TEMPLATES["chatml"]
    with pytest.raises(ValueError, match="split"):
        llama_flags.check_gpu_layers(3, "cuda", 30)
    llama_flags.check_gpu_layers(30, "cuda", 30)
    llama_flags.check_gpu_layers(3, "cpu", 30)          # a maximum: no layer in VRAM on the CPU
