"""Reliability soak of the OpenAI-compatible server (``models.serve``).

Many concurrent clients on loopback, bounded in count (``--requests``) and time
(``--time-limit``), send a cycle of request kinds:

* ``complete`` / ``stream``: greedy completions, non-streamed and streamed (the
  official ``openai`` client); each must equal its reference, the prompt's
  greedy completion sent alone before the soak (or given by the caller, e.g.
  ``Model.generate``). Batched and alone agree exactly in float32 on the CPU
  (the engine's tests); in bfloat16 on a GPU a batch may resolve a near-tie the
  other way, so a GPU soak runs with ``--dtype float32``;
* ``chat``: a greedy chat completion, against its reference the same way;
* ``abandon``: a sampled stream the client closes after two events (the
  server must cancel it and free its slot);
* ``malformed``: bodies that are not JSON, not an object, or lack the prompt;
  ``over_length``: a prompt longer than the context; ``past_context``:
  ``max_tokens`` past it; ``unknown_model``: each must get a 4xx.

Afterwards the engine must drain (``/health``: no active slot, nothing
waiting or prefilling, no reserved working set), every valid and abandoned
request must have finished (the ``finished`` counters moved by exactly that
many), and the server must still answer a greedy request correctly. The
report (JSON and Markdown) counts every kind, its failures and latencies;
the exit status is 1 unless everything passed.

Against a running server, or one this process starts (``--serve``, the rest of
the arguments as ``python -m models.serve`` takes them)::

    python -m benchmarks.soak --serve --model smollm2-135m --dtype float32 --slots 8 --max-len 1024 \\
        --clients 32 --requests 400 --time-limit 300
    python -m benchmarks.soak --base-url http://127.0.0.1:8000 --clients 16 --requests 200
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np

PROMPTS = ("The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
           "The three primary colors are", "Water boils at", "import numpy as np\n")
CHAT = ("What is the capital of France?", "Name three colors.")
KINDS = ("complete", "stream", "abandon", "malformed", "chat", "over_length", "past_context", "unknown_model")
#: the request kinds that finish in the engine (the others are refused before it)
ENGINE_KINDS = ("complete", "stream", "abandon", "chat")


@contextlib.contextmanager
def serving(serve_argv: list[str]):
    """A server from ``python -m models.serve`` arguments on a uvicorn thread (a free
    loopback port; ``--host``/``--port`` are ignored): yields ``(base_url, model_name)``."""
    from models.cli.serve import build_parser, make_engine
    from models.serving.server import serve_in_thread

    engine, name = make_engine(build_parser().parse_args(serve_argv))
    with serve_in_thread(engine.start(), name) as base:
        yield base, name


def health(base: str) -> dict:
    import httpx

    return httpx.get(f"{base}/health", timeout=30).json()


def greedy_references(client, model: str, max_tokens: int, chat: bool = True) -> dict[str, str]:
    """Each prompt's greedy completion (and each chat question's reply), sent one at a time."""
    refs = {p: client.completions.create(model=model, prompt=p, max_tokens=max_tokens, temperature=0)
            .choices[0].text for p in PROMPTS}
    for q in CHAT if chat else ():
        refs["chat:" + q] = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": q}], max_tokens=max_tokens,
            temperature=0).choices[0].message.content
    return refs


def _requests(base: str, model: str, client, refs: dict, max_tokens: int, max_len: int) -> dict[str, Callable]:
    """One function per kind: ``fn(i) -> None`` (passed) or a failure message."""
    import httpx

    def complete(i):
        p = PROMPTS[i % len(PROMPTS)]
        got = client.completions.create(model=model, prompt=p, max_tokens=max_tokens, temperature=0).choices[0].text
        return None if got == refs[p] else f"{p!r}: {got!r} != {refs[p]!r}"

    def stream(i):
        p = PROMPTS[i % len(PROMPTS)]
        got = "".join(c.choices[0].text for c in client.completions.create(
            model=model, prompt=p, max_tokens=max_tokens, temperature=0, stream=True))
        return None if got == refs[p] else f"{p!r} streamed: {got!r} != {refs[p]!r}"

    def chat(i):
        q = CHAT[i % len(CHAT)]
        got = client.chat.completions.create(model=model, messages=[{"role": "user", "content": q}],
                                             max_tokens=max_tokens, temperature=0).choices[0].message.content
        return None if got == refs["chat:" + q] else f"chat {q!r}: {got!r} != {refs['chat:' + q]!r}"

    def abandon(i):
        body = {"model": model, "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": max(4 * max_tokens, max_len // 2),
                "temperature": 0.7, "seed": i, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=120) as r:
            if r.status_code != 200:
                return f"abandoned stream got HTTP {r.status_code}"
            for n, _ in enumerate(r.iter_lines()):
                if n >= 2:
                    break
        return None

    def refused(body: bytes | dict, status=(400, 499)):
        kw = {"json": body} if isinstance(body, dict) else {"content": body}
        r = httpx.post(f"{base}/v1/completions", timeout=60, **kw)
        ok = status[0] <= r.status_code <= status[1]
        return None if ok else f"{str(body)[:60]!r} got HTTP {r.status_code}, want a 4xx"

    def malformed(i):
        return refused([b"{", b"[1, 2]", json.dumps({"model": model}).encode(),
                        json.dumps({"model": model, "prompt": []}).encode()][i % 4])

    def over_length(i):
        return refused({"model": model, "prompt": "word " * (2 * max_len), "max_tokens": 4})

    def past_context(i):
        return refused({"model": model, "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": 2 * max_len})

    def unknown_model(i):
        return refused({"model": model + "-nope", "prompt": "x", "max_tokens": 4})

    return dict(complete=complete, stream=stream, abandon=abandon, malformed=malformed, chat=chat,
                over_length=over_length, past_context=past_context, unknown_model=unknown_model)


def run_soak(base: str, model: str, *, clients: int = 8, requests: int = 48, time_limit: float = 300.0,
             max_tokens: int = 12, refs: dict | None = None, kinds=KINDS, progress: bool = False) -> dict:
    """Soak a running server; returns the report (``passed`` and what failed)."""
    import openai

    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=max(60.0, time_limit))
    h0 = health(base)
    if "max_len" not in h0:
        raise ValueError(f"{base}/health does not report max_len (the context per slot): not a sparse-jax server?")
    max_len = int(h0["max_len"])
    t0 = time.perf_counter()
    refs = dict(refs) if refs is not None else greedy_references(client, model, max_tokens, "chat" in kinds)
    ref_s = time.perf_counter() - t0
    fns = _requests(base, model, client, refs, max_tokens, max_len)
    jobs = [(kinds[i % len(kinds)], i) for i in range(requests)]
    before = health(base)["finished"]

    def one(job):
        kind, i = job
        t = time.perf_counter()
        try:
            err = fns[kind](i)
        except Exception as e:  # noqa: BLE001 - any client-side exception is this request's failure
            err = f"{type(e).__name__}: {e}"
        return kind, i, err, time.perf_counter() - t

    results, failures = [], []
    start = time.perf_counter()
    pool = concurrent.futures.ThreadPoolExecutor(clients, thread_name_prefix="soak-client")
    futures = [pool.submit(one, job) for job in jobs]
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(futures), desc="soak", unit="req", file=sys.stderr)
    try:
        for f in concurrent.futures.as_completed(futures, timeout=time_limit):
            results.append(f.result())
            if bar is not None:
                bar.update()
    except concurrent.futures.TimeoutError:
        pass
    finally:
        if bar is not None:
            bar.close()
        pool.shutdown(wait=False, cancel_futures=True)
    wall = time.perf_counter() - start
    done = {(k, i) for k, i, _, _ in results}
    failures += [{"kind": k, "i": i, "error": "not finished within --time-limit"} for k, i in jobs
                 if (k, i) not in done]
    failures += [{"kind": k, "i": i, "error": err} for k, i, err, _ in results if err is not None]
    # the engine drains: every valid and abandoned request finished, nothing left reserved
    drained, after = False, {}
    end = time.time() + 120
    while time.time() < end:
        after = health(base)
        # running counts a request between the queue and its slot (its prefill may hold pages)
        if after["running"] == 0 and after["waiting"] == 0 and after["active_slots"] == 0 \
                and after["working_set_bytes"] == 0:
            drained = True
            break
        time.sleep(0.1)
    finished = {k: v - before.get(k, 0) for k, v in after.get("finished", {}).items()}
    want_finished = sum(1 for k, _ in jobs if k in ENGINE_KINDS)
    got_finished = sum(finished.values())
    p = PROMPTS[0]
    last = client.completions.create(model=model, prompt=p, max_tokens=max_tokens, temperature=0).choices[0].text
    still_answers = after.get("status") == "ok" and last == refs[p]
    per_kind = {}
    for kind in kinds:
        lat = [dt for k, _, err, dt in results if k == kind]
        per_kind[kind] = {"sent": sum(1 for k, _ in jobs if k == kind),
                          "failed": sum(1 for f in failures if f["kind"] == kind),
                          "median_s": float(np.median(lat)) if lat else None,
                          "max_s": float(np.max(lat)) if lat else None}
    passed = not failures and drained and got_finished == want_finished and still_answers
    return {"passed": passed, "requests": requests, "clients": clients, "time_limit_s": time_limit,
            "wall_s": wall, "references_s": ref_s, "max_len": max_len, "per_kind": per_kind,
            "failures": failures[:50], "failure_count": len(failures), "drained": drained,
            "finished": finished, "finished_want": want_finished, "finished_got": got_finished,
            "still_answers": still_answers, "health_after": after, "slots": h0.get("slots")}


def render(report: dict, stamp_: dict) -> str:
    from benchmarks.timing import markdown_table

    rows = [{"kind": k, **{c: (round(v, 3) if isinstance(v, float) else v) for c, v in d.items()}}
            for k, d in report["per_kind"].items()]
    md = ["# Server reliability soak", "",
          f"- device: {stamp_['device']} ({stamp_['backend']}), jax {stamp_['jax']}, {stamp_['date']}, "
          f"commit {stamp_['git_commit']}",
          f"- command: `{stamp_['command']}`",
          f"- {report['requests']} requests from {report['clients']} concurrent clients on loopback, "
          f"{report['slots']} slots of {report['max_len']} tokens, {report['wall_s']:.1f} s "
          f"(at most {report['time_limit_s']} s)",
          f"- **{'PASSED' if report['passed'] else 'FAILED'}**: {report['failure_count']} failed requests; "
          f"drained {report['drained']}; finished in the engine {report['finished_got']} of "
          f"{report['finished_want']} ({report['finished']}); the server still answers correctly: "
          f"{report['still_answers']}", "",
          markdown_table(rows, list(rows[0])), ""]
    if report["failures"]:
        md += ["Failures (first 50):", ""] + [f"- {f['kind']} #{f['i']}: {f['error']}" for f in report["failures"]]
    return "\n".join(md)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # allow_abbrev=False: models.serve's --model must not be taken for an abbreviation of --model-name
    p = argparse.ArgumentParser(prog="python -m benchmarks.soak", description=__doc__.split("\n\n")[0],
                                allow_abbrev=False,
                                epilog="With --serve, every argument this parser does not know goes to "
                                       "models.serve (e.g. --model, --attention, --offload, --slots, --max-len).")
    p.add_argument("--serve", action="store_true", help="start a server in this process (models.serve arguments)")
    p.add_argument("--base-url", default=None, help="a running server, e.g. http://127.0.0.1:8000")
    p.add_argument("--model-name", default=None, help="the model id the running server serves (default: asked)")
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--requests", type=int, default=160)
    p.add_argument("--time-limit", type=float, default=300.0, help="seconds for the whole soak at most")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--kinds", default=",".join(KINDS), help=f"request kinds to cycle through (of {', '.join(KINDS)}; "
                                                         f"a base model without a chat template: leave out chat)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--out", default=None, help="results directory (default benchmarks/results)")
    p.add_argument("--name", default="soak")
    a, serve_argv = p.parse_known_args(argv)
    if a.serve == (a.base_url is not None):
        p.error("give either --serve (and models.serve's arguments) or --base-url")
    if serve_argv and not a.serve:
        p.error(f"unrecognized arguments: {' '.join(serve_argv)}")
    if a.clients < 1 or a.requests < 1 or a.time_limit <= 0 or a.max_tokens < 1:
        p.error("--clients, --requests, --time-limit and --max-tokens must be positive")
    kinds = tuple(k for k in a.kinds.split(",") if k)
    if not kinds or set(kinds) - set(KINDS):
        p.error(f"--kinds: a comma-separated subset of {','.join(KINDS)}")
    from benchmarks.timing import stamp, write_results

    st = stamp()
    with contextlib.ExitStack() as stack:
        if a.serve:
            try:
                base, name = stack.enter_context(serving(serve_argv))
            except (ValueError, TypeError, FileNotFoundError) as e:  # a bad model, method or option
                p.error(str(e))
        else:
            base, name = a.base_url.rstrip("/"), a.model_name
        if name is None:
            import httpx

            name = httpx.get(f"{base}/v1/models", timeout=30).json()["data"][0]["id"]
        report = run_soak(base, name, clients=a.clients, requests=a.requests, time_limit=a.time_limit,
                          max_tokens=a.max_tokens, kinds=kinds, progress=not a.no_progress)
    md = render(report, st)
    write_results(a.name, {"stamp": st, **report}, md, Path(a.out) if a.out else None)
    print(md)
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
