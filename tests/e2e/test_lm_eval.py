"""lm-evaluation-harness itself (`lm_eval --model local-completions`) against a real server on the default model: a
multiple-choice task of our own (tests/e2e/data/mc20.jsonl, 20 questions, read from disk, nothing from a hub), its
tokenizer read from the server (/tokenizer_info, /tokenize: lm-eval picks the remote backend by itself). Each
question's log-likelihoods equal the teacher-forced log-softmax of Model.logits (computed here), and are the same
at concurrency 1 and 8.

lm-eval is not in the test extra (it brings datasets, pandas, scikit-learn, ...): the test runs where `lm_eval`
is found (FASTSERVE_LM_EVAL=path/to/lm_eval, else on PATH) and says so when it skips. By hand:
`python -m venv /tmp/lme && /tmp/lme/bin/pip install 'lm-eval[api]==0.4.*'`, then FASTSERVE_LM_EVAL=/tmp/lme/bin/lm_eval."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from fastserve.scoring import log_softmax

from .conftest import ServerProc

DATA = Path(__file__).parent / "data" / "mc20.jsonl"
TASK = """task: fastserve_mc20
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


def _lm_eval() -> str | None:
    """FASTSERVE_LM_EVAL, else the test extra's (beside this interpreter), else one on PATH."""
    beside = os.path.join(os.path.dirname(sys.executable), "lm_eval")
    return os.environ.get("FASTSERVE_LM_EVAL") or (beside if os.access(beside, os.X_OK) else shutil.which("lm_eval"))


pytestmark = [pytest.mark.model,
              pytest.mark.skipif(_lm_eval() is None, reason="lm-evaluation-harness is not installed (the test extra's "
                                 "lm_eval not beside this Python nor on PATH, FASTSERVE_LM_EVAL unset): see this file's "
                                 "docstring")]


def _run(url: str, tasks: Path, out: Path, concurrent: int) -> dict:
    """doc_id -> [(loglikelihood, is_greedy) per choice] of one lm_eval run, and the run's accuracy."""
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    subprocess.run([_lm_eval(), "--model", "local-completions", "--model_args",
                    f"model=m,base_url={url}/v1/completions,num_concurrent={concurrent}", "--include_path", str(tasks),
                    "--tasks", "fastserve_mc20", "--log_samples", "--output_path", str(out)],
                   check=True, env=env, cwd=out.parent, capture_output=True, timeout=600)
    [samples] = out.glob("*/samples_fastserve_mc20_*.jsonl")
    docs = [json.loads(line) for line in samples.read_text().splitlines()]
    return {d["doc_id"]: (d["doc"], [d["arguments"][f"gen_args_{i}"] for i in range(len(d["resps"]))],
                          [(float(r[0][0]), r[0][1] == "True") for r in d["resps"]]) for d in docs}


def _expected(model, context: str, continuation: str) -> tuple[float, bool]:
    """lm-eval's loglikelihood of continuation after context, from Model.logits: the pair split and encoded as
    lm-eval does it (context's trailing spaces moved to the continuation; encode(context + continuation) cut
    after encode(context)), without special tokens (its remote tokenizer asks /tokenize so)."""
    n = len(context) - len(context.rstrip())
    if n:
        context, continuation = context[:-n], context[-n:] + continuation
    enc = lambda s: model.tokenizer.encode(s, add_special=False)      # noqa: E731
    whole, ctx = enc(context + continuation), enc(context)
    rows = log_softmax(model.logits(whole))
    at = range(len(ctx), len(whole))
    return (float(sum(rows[i - 1, whole[i]] for i in at)), all(int(np.argmax(rows[i - 1])) == whole[i] for i in at))


def test_lm_eval_scores_are_the_teacher_forced_ones_at_any_concurrency(default_model_file, default_model, tmp_path):
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "fastserve_mc20.yaml").write_text(TASK.format(data=DATA.resolve()))
    with ServerProc(default_model_file, tmp_path / "server.log", "-c", "4096", "-np", "8") as srv:
        one = _run(srv.url, tasks, tmp_path / "c1", 1)
        eight = _run(srv.url, tasks, tmp_path / "c8", 8)
    assert len(one) == 20 and one == eight              # every log-likelihood the same bits at concurrency 8
    right = 0
    for doc, args, resps in one.values():
        want = [_expected(default_model, a["arg_0"], a["arg_1"]) for a in args]
        for (got, greedy), (exp, exp_greedy) in zip(resps, want):
            assert abs(got - exp) < 1e-4 and greedy == exp_greedy
        right += int(np.argmax([w for w, _ in want]) == doc["answer"])
    assert right >= 12, f"{right} of 20 right: a 135M model knows these, scores at chance would not"
