"""lm-eval against the server, as a user runs it (``make eval-clients``; not in ``make test``:
lm-eval needs torch).

1. Exports the served tokenizer (``sparse-jax-export-tokenizer``).
2. Starts ``python -m models.serve`` (SmolLM2-135M, f32, CPU) on a free loopback port.
3. Runs lm-eval's ``local-completions`` (token-id requests, ``--batch_size 2``) on two local
   tasks written to a temporary directory: a 4-question multiple-choice task (loglikelihood:
   ``echo`` + ``logprobs``) and a 4-question generation task (``generate_until``, batched
   prompts with ``stop``).
4. Checks every logged loglikelihood against the model's own (``Model.forward``, f32
   log-softmax, within 1e-3) and every generation against ``Model.generate`` greedy, then
   prints lm-eval's table.

``python scripts/lm_eval_check.py --lm-eval-python PATH`` (an interpreter with lm-eval);
exits non-zero on any mismatch.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

import numpy as np

# lm-eval joins a question and a choice with its target delimiter, one space
QUESTIONS = [
    ("The capital of France is", ["Paris", "London", "Berlin", "Madrid"], 0),
    ("The largest planet in the solar system is", ["Mars", "Jupiter", "Venus", "Mercury"], 1),
    ("Water freezes at a temperature of", ["100 degrees", "50 degrees", "0 degrees", "10 degrees"], 2),
    ("The opposite of hot is", ["warm", "loud", "bright", "cold"], 3),
]


def _greedy_answer(model, q: str) -> str:
    """``Model.generate``'s 8 greedy tokens, cut where the task's ``until`` cuts."""
    want = model.generate(q, max_new_tokens=8)
    cut = min([i for i in (want.find("\n"), want.find(".")) if i >= 0], default=len(want))
    return want[:cut]

MC_TASK = """task: sparse_jax_mc
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
"""

GEN_TASK = """task: sparse_jax_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{target}}}}"
generation_kwargs:
  until: ["\\n", "."]
  max_gen_toks: 8
  do_sample: false
  temperature: 0.0
metric_list:
  - metric: exact_match
"""


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(url: str, proc, timeout: float = 300) -> None:
    end = time.time() + timeout
    while time.time() < end:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise SystemExit("the server did not come up")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lm-eval-python", required=True, help="an interpreter with lm-eval installed")
    p.add_argument("--model", default="smollm2-135m")
    a = p.parse_args(argv)

    import jax.numpy as jnp

    import models

    tmp = tempfile.mkdtemp(prefix="sparse-jax-lm-eval-")
    tok_dir = os.path.join(tmp, "tokenizer")
    subprocess.run([sys.executable, "-m", "models.cli.export_tokenizer", a.model, tok_dir], check=True)
    mc = os.path.join(tmp, "mc.jsonl")
    gen = os.path.join(tmp, "gen.jsonl")
    with open(mc, "w") as f:
        for q, ch, ans in QUESTIONS:
            f.write(json.dumps({"question": q, "choices": ch, "answer": ans}) + "\n")
    model = models.load_model(a.model, dtype=jnp.float32, max_len=1024)
    with open(gen, "w") as f:
        for q, _, _ in QUESTIONS:  # the target: the model's own greedy answer (exact_match must be 1)
            f.write(json.dumps({"question": q, "target": _greedy_answer(model, q)}) + "\n")
    tasks = os.path.join(tmp, "tasks")
    os.makedirs(tasks)
    with open(os.path.join(tasks, "mc.yaml"), "w") as f:
        f.write(MC_TASK.format(data=mc))
    with open(os.path.join(tasks, "gen.yaml"), "w") as f:
        f.write(GEN_TASK.format(data=gen))

    port = _port()
    server = subprocess.Popen([sys.executable, "-m", "models.serve", "--model", a.model, "--port", str(port),
                               "--slots", "4", "--max-len", "1024", "--dtype", "float32"])
    try:
        _wait(f"http://127.0.0.1:{port}/health", server)
        out = os.path.join(tmp, "out")
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        args = (f"model={a.model},base_url=http://127.0.0.1:{port}/v1/completions,tokenizer={tok_dir},"
                "tokenized_requests=True,num_concurrent=2,max_retries=1")
        t0 = time.time()
        subprocess.run([a.lm_eval_python, "-m", "lm_eval", "--model", "local-completions", "--model_args", args,
                        "--tasks", "sparse_jax_mc,sparse_jax_gen", "--include_path", tasks, "--batch_size", "2",
                        "--output_path", out, "--log_samples"], check=True, env=env)
        took = time.time() - t0
    finally:
        server.terminate()
        server.wait(30)

    bad = []
    tok = model.tokenizer
    mc_rows = [json.loads(x) for f in glob.glob(f"{out}/**/samples_sparse_jax_mc_*.jsonl", recursive=True)
               for x in open(f)]
    for row in mc_rows:
        q = row["doc"]["question"]
        for (ll, _greedy), choice in zip([r[0] for r in row["resps"]], row["doc"]["choices"]):
            ctx, cont = tok.encode(q), tok.encode(q + " " + choice)[len(tok.encode(q)):]
            ids = ctx + cont
            logits = np.asarray(model.forward(jnp.asarray([ids], jnp.int32)))[0].astype(np.float64)
            lp = logits - logits.max(-1, keepdims=True)
            lp -= np.log(np.exp(lp).sum(-1, keepdims=True))
            want = sum(lp[i - 1, ids[i]] for i in range(len(ctx), len(ids)))
            if abs(float(ll) - want) > 1e-3:
                bad.append(f"loglikelihood of {q!r} + {choice!r}: lm-eval {ll}, the model {want}")
    gen_rows = [json.loads(x) for f in glob.glob(f"{out}/**/samples_sparse_jax_gen_*.jsonl", recursive=True)
                for x in open(f)]
    for row in gen_rows:
        q = row["doc"]["question"]
        got, want = row["resps"][0][0], _greedy_answer(model, q)
        if got != want:
            bad.append(f"generation for {q!r}: lm-eval got {got!r}, Model.generate {want!r}")
    results = [json.load(open(f)) for f in glob.glob(f"{out}/**/results_*.json", recursive=True)]
    acc = results[0]["results"]["sparse_jax_mc"]["acc,none"] if results else None
    em = results[0]["results"]["sparse_jax_gen"]["exact_match,none"] if results else None
    if em != 1.0:
        bad.append(f"exact_match against the model's own greedy answers is {em}, not 1")
    print(f"lm-eval local-completions against the server: {len(mc_rows)} multiple-choice docs "
          f"({sum(len(r['resps']) for r in mc_rows)} loglikelihood requests, acc {acc}), {len(gen_rows)} "
          f"generations (exact_match {em}), {took:.0f} s; {len(bad)} mismatches")
    for b in bad:
        print("  MISMATCH", b)
    if len(mc_rows) != len(QUESTIONS) or len(gen_rows) != len(QUESTIONS):
        print("  lm-eval did not log every doc")
        return 1
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
