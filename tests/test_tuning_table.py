"""The tuned-config table (pallas_kernels/tuning.py): shape classes, precedence of
the caller's tuning, entries per device kind (a device reads only its own), and that
every shipped entry is a configuration its kernel accepts (a bad entry would only fail
on the GPU, where the table is read)."""

from __future__ import annotations

import json

import pytest

from pallas_kernels import tuning
from pallas_kernels.block_sparse_decode import TUNING_KEYS as BLOCK_KEYS, resolve_block_tuning
from pallas_kernels.labels import Q_PREPS, TUNING_KEYS as LABEL_KEYS
from pallas_kernels.quantized_boxes import PREPS
from pallas_kernels.sparse_decode import TUNING_KEYS as SPARSE_KEYS, resolve_sparse_tuning
from pallas_kernels.split_merge import MERGES
from pallas_kernels.topk import SEARCHES, plan_topk
from pallas_kernels.tuning import tuned
from sparse_jax.ops.selection import TUNING_KEYS as TOPK_KEYS


def test_shape_class_rounds_rows_and_lengths_but_not_head_dim():
    a = tuning.shape_class("sparse_decode", rows=60, k=1500, d=128, g=4)
    assert a == "sparse_decode|rows=64|k=2048|d=128|g=4"
    assert tuning.shape_class("sparse_decode", rows=64, k=2048, d=128, g=4) == a
    assert tuning.shape_class("sparse_decode", rows=64, k=2048, d=64, g=4) != a
    with pytest.raises(ValueError, match="needs exactly"):
        tuning.shape_class("sparse_decode", rows=64, k=2048, d=128)


H200, H100 = "NVIDIA H200", "NVIDIA H100 80GB HBM3"


@pytest.fixture
def device_kind():
    """``device_kind(name)`` looks the table up as on that device for this test (the CPU
    that runs the tests reads no entries of its own); the classes the test missed are
    forgotten after it (in a process that stays on one device, a class missed on B is not
    also found on A)."""
    missed = set(tuning._MISSED)
    yield tuning.set_device_kind
    tuning.set_device_kind(None)
    tuning._MISSED.intersection_update(missed)


def test_callers_tuning_wins_and_unmeasured_classes_get_defaults(monkeypatch):
    key = tuning.shape_class("sparse_decode", rows=64, k=2048, d=128, g=4)
    monkeypatch.setattr(tuning, "_table", lambda: {key: {"config": {"block_k": 128, "num_splits": 5}}})
    dims = dict(rows=64, k=2048, d=128, g=4)
    assert tuning.with_tuned({}, "sparse_decode", **dims) == {"block_k": 128, "num_splits": 5}
    assert tuning.with_tuned({"block_k": None}, "sparse_decode", **dims) == {"block_k": 128, "num_splits": 5}
    assert tuning.with_tuned({"block_k": 32}, "sparse_decode", **dims) == {"block_k": 32}
    assert tuning.with_tuned({}, "sparse_decode", rows=8, k=2048, d=128, g=4) == {}


def test_the_shipped_table_is_keyed_by_device_kind():
    """The table moved to ``devices[kind][class]`` with every entry under the device that
    measured it: the 57 entries of the flat table (34 measured on the H200, 23 on the H100)."""
    shipped = json.loads(tuning.TABLE_PATH.read_text())
    assert set(shipped) == {"about", "devices"}
    devices = shipped["devices"]
    assert {kind: len(entries) for kind, entries in devices.items()} == {H200: 34, H100: 23}
    for kind, entries in devices.items():
        assert all(entry["device"] == kind for entry in entries.values()), kind


def test_an_entry_is_read_only_on_its_device_kind(monkeypatch, device_kind):
    """Device A's entry reaches A's lookups; device B (no entry for the class), a device the
    table does not know, and a backend that is not a GPU get the kernels' defaults, and the
    class is listed as untuned."""
    dims = dict(rows=64, k=2048, d=128, g=4)
    key = tuning.shape_class("sparse_decode", **dims)
    other = tuning.shape_class("sparse_decode", rows=8, k=512, d=128, g=4)
    monkeypatch.setattr(tuning, "_tables", lambda: {"A": {key: {"config": {"block_k": 64, "num_splits": 3}}},
                                                    "B": {other: {"config": {"block_k": 32}}}})
    tuning._MISSED.discard(key)
    device_kind("A")
    assert tuning.device_kind() == "A"
    assert tuning.tuned("sparse_decode", **dims) == {"block_k": 64, "num_splits": 3}
    assert tuning.with_tuned({}, "sparse_decode", **dims) == {"block_k": 64, "num_splits": 3}
    assert key not in tuning.untuned_classes()
    device_kind("B")
    assert tuning.tuned("sparse_decode", **dims) == {} and tuning.with_tuned({}, "sparse_decode", **dims) == {}
    assert key in tuning.untuned_classes()
    assert tuning.tuned("sparse_decode", rows=8, k=512, d=128, g=4) == {"block_k": 32}  # B's own entry
    device_kind("NVIDIA B200")
    assert tuning.tuned("sparse_decode", **dims) == {}
    device_kind(None)  # back to the detected device: the CPU here, which reads no entries
    assert tuning.device_kind() is None and tuning.tuned("sparse_decode", **dims) == {}


def test_the_shipped_entries_of_one_gpu_are_not_used_on_the_other(device_kind):
    """An H200 class (B=8, 128K, K=2048) and an H100 one (head_dim 256) each reach only
    their own device's lookups."""
    h200 = dict(rows=64, k=2048, d=128, g=4)
    h100 = dict(rows=8, k=2048, d=256, g=4)
    device_kind(H200)
    assert tuning.tuned("sparse_decode", **h200) and tuning.tuned("sparse_decode", **h100) == {}
    device_kind(H100)
    assert tuning.tuned("sparse_decode", **h100) and tuning.tuned("sparse_decode", **h200) == {}
    assert tuning.shape_class("sparse_decode", **h200) in tuning.untuned_classes()


def test_the_device_kind_is_read_once_from_the_default_gpu(monkeypatch):
    """Without an override the kind is the default backend's first device's, when that
    backend is a GPU, read on the first lookup and kept."""
    import jax

    calls = []

    class Device:
        device_kind = H200

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(jax, "devices", lambda *a: calls.append(a) or [Device()])
    tuning._detected_device_kind.cache_clear()
    tuning._table.cache_clear()
    try:
        assert tuning.device_kind() == H200 and tuning.device_kind() == H200 and len(calls) == 1
        assert tuning.tuned("sparse_decode", rows=64, k=2048, d=128, g=4)
        monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
        tuning._detected_device_kind.cache_clear()
        assert tuning.device_kind() is None
    finally:
        tuning._detected_device_kind.cache_clear()
        tuning._table.cache_clear()


def test_every_shipped_entry_is_accepted_by_its_kernel():
    devices = json.loads(tuning.TABLE_PATH.read_text())["devices"]
    table = [(key, entry) for entries in devices.values() for key, entry in entries.items()]
    assert table, "the shipped table is empty"
    allowed = {"sparse_decode": SPARSE_KEYS, "block_sparse_decode": BLOCK_KEYS, "label_scores": LABEL_KEYS,
               "block_label_scores": LABEL_KEYS, "quest_block_scores": ("block_n", "num_warps", "num_stages"),
               "quest_block_scores_q8": ("block_n", "num_warps", "num_stages", "mode", "prep", "tiles"),
               "topk": TOPK_KEYS}
    for key, entry in table:
        kernel, *dims = key.split("|")
        dims = {n: int(v) for n, v in (d.split("=") for d in dims)}
        assert tuning.shape_class(kernel, **dims) == key  # the key is canonical
        cfg = entry["config"]
        assert set(cfg) <= set(allowed[kernel]), (key, cfg)
        assert entry["device"] and entry["measured_at"], key
        if kernel in ("label_scores", "block_label_scores"):
            assert cfg.get("q_prep", "xla") in Q_PREPS and not (cfg.get("q_prep") == "kernel"
                                                               and cfg.get("hoist_q") is False), (key, cfg)
        if kernel in ("sparse_decode", "block_sparse_decode"):
            assert cfg.get("merge", "xla") in MERGES, (key, cfg)
        if kernel == "sparse_decode":
            resolve_sparse_tuning(dims["rows"] // 8 or 1, 8, dims["k"], dims["d"], block_k=cfg.get("block_k"),
                                  num_splits=cfg.get("num_splits"))
        if kernel == "block_sparse_decode":
            resolve_block_tuning(dims["rows"] // 8 or 1, 8, dims["k"] // dims["block"], dims["d"], dims["block"],
                                 block_k=cfg.get("block_k"), num_splits=cfg.get("num_splits"))
        if kernel == "quest_block_scores_q8":
            assert cfg.get("mode", "dot") in ("fma", "dot", "imma") and cfg.get("block_n", 64) >= 16, (key, cfg)
            assert cfg.get("prep", "program") in PREPS, (key, cfg)
            assert isinstance(cfg.get("tiles", 1), int) and cfg.get("tiles", 1) >= 1, (key, cfg)
        if kernel == "topk":
            plan_args = {a: cfg[a] for a in ("max_single", "chunk", "block_rows", "num_warps") if a in cfg}
            assert plan_topk(dims["n"], dims["k"], **plan_args) is not None, (key, cfg)
            assert cfg.get("search", "radix") in SEARCHES, (key, cfg)


def test_topk_sweep_shapes_parse():
    from benchmarks.tune import TOPK_SHAPES, parse_topk_shapes

    assert parse_topk_shapes("8x8192:2048,64x2048:127") == [(8, 8192, 2048), (64, 2048, 127)]
    assert parse_topk_shapes(",".join(f"{r}x{n}:{k}" for r, n, k in TOPK_SHAPES)) == list(TOPK_SHAPES)
    with pytest.raises(SystemExit, match="ROWSxN:K"):
        parse_topk_shapes("8x8192")


def test_topk_sweep_candidates_by_search(device_kind):
    """Both searches by default; a bracket-only sweep keeps the table's entry (when the class
    has one on this device) as its comparison, and every candidate names its knobs."""
    from benchmarks.tune import topk_candidates

    device_kind(H200)  # the class's entry was measured there
    both = topk_candidates(8192, 2048)
    assert {c.get("search", "radix") for c in both} == {"radix", "bracket"}
    assert all("radix_bits" not in c for c in both if c.get("search") == "bracket")
    only = topk_candidates(8192, 2048, ("bracket",), rows=8)
    current = tuned("topk", rows=8, n=8192, k=2048)
    assert current and only[0] == current and all(c["search"] == "bracket" for c in only[1:])
    assert topk_candidates(8192, 2048, ("bracket",)) == only[1:]  # no class: nothing to add


def test_topk_sweep_scores_by_class():
    """The top-k sweep times the token selection on label-like scores (sums of 4 softmaxes:
    non-negative, each row summing to 4) and the block filter on normal ones."""
    import jax
    import numpy as np
    from benchmarks.tune import topk_sweep_scores

    labels, kind = topk_sweep_scores(jax.random.key(0), 3, 8192)
    assert kind == "labels" and labels.shape == (3, 8192)
    np.testing.assert_allclose(np.asarray(labels).sum(-1), 4.0, rtol=1e-4)
    assert float(labels.min()) >= 0.0
    normal, kind = topk_sweep_scores(jax.random.key(0), 3, 2048)
    assert kind == "normal" and float(normal.min()) < 0.0
    assert topk_sweep_scores(jax.random.key(0), 2, 2048, "labels")[1] == "labels"
    with pytest.raises(ValueError, match="auto, labels or normal"):
        topk_sweep_scores(jax.random.key(0), 2, 64, "uniform")


def test_tune_sweep_reports_what_it_timed_and_a_cut_short_sweep_keeps_the_table_entry(tmp_path, monkeypatch):
    """``benchmarks.tune.sweep`` says which configs it timed and whether its time budget cut it
    short; ``write_table`` lets such a sweep replace a class's entry only when it timed that
    entry too (a 32K label sweep cut short once overwrote a full 128K one)."""
    import jax.numpy as jnp
    from benchmarks import tune
    from benchmarks.tune import SweepBest, config_key, sweep, write_table

    x = jnp.arange(8.0)

    def fn(a, *, shift, pad=None):
        return a + shift

    rows = []
    best = sweep("toy", fn, (x,), x, [dict(shift=0.0), dict(shift=1.0), dict(shift=0.0, pad=None)], 32, 2, rows, "toy")
    assert best and best.complete and best.config["shift"] == 0.0
    # the wrong config (shift=1) is a row but not "tried"; None knobs key as absent
    assert best.tried == {config_key(dict(shift=0.0))} and len(rows) == 3

    def runs_out(a, *, shift):  # the budget runs out while the first config is traced
        monkeypatch.setattr(tune, "DEADLINE", 0.0)
        return a + shift

    cut = sweep("toy", runs_out, (x,), x, [dict(shift=0.0), dict(shift=0.5)], 32, 2, rows, "toy")
    assert cut and not cut.complete and cut.tried == {config_key(dict(shift=0.0))} and len(rows) == 4
    cut = sweep("toy", fn, (x,), x, [dict(shift=0.0)], 32, 2, rows, "toy")  # past the deadline: no inputs built
    assert not cut and not cut.complete and len(rows) == 4
    assert sweep("toy", fn, (x,), x, [], 32, 2, rows, "toy").complete  # nothing to skip

    # join: the faster config, whole only if both halves were, the union of what was timed
    a = SweepBest({"w": 2}, 2.0, True, frozenset({"a"}))
    b = SweepBest({"w": 4}, 1.0, False, frozenset({"b"}))
    assert a.join(b) == SweepBest({"w": 4}, 1.0, False, frozenset({"a", "b"}))
    assert a.join(SweepBest(None)) == a

    path = tmp_path / "table.json"
    entry = {"config": {"w": 2, "mode": "x"}, "ms": 0.5, "measured_at": "S=128K", "device": "d", "date": "t"}
    theirs = {c: {**entry, "device": "e"} for c in ("c1", "c2", "c3", "c4")}
    path.write_text(json.dumps({"devices": {"d": {"c1": entry, "c2": entry, "c3": entry}, "e": theirs}}))
    info = {"device": "d", "date": "now"}
    new = {"w": 8, "mode": "x", "unset": None}
    write_table(path, {
        "c1": (SweepBest(new, 0.4, False, frozenset({config_key(new)})), "S=32K"),  # never timed c1's entry: kept
        "c2": (SweepBest(new, 0.4, False, frozenset({config_key(new), config_key(entry["config"])})), "S=32K"),
        "c3": (SweepBest(new, 0.6, True, frozenset({config_key(new)})), "S=32K"),  # a whole sweep is the word
        "c4": (SweepBest(new, 0.4, False, frozenset({config_key(new)})), "S=32K"),  # a new class
    }, info)
    devices = json.loads(path.read_text())["devices"]
    configs = devices["d"]
    assert configs["c1"] == entry
    for c in ("c2", "c3", "c4"):
        assert configs[c]["config"] == {"w": 8, "mode": "x"} and configs[c]["measured_at"] == "S=32K"
        assert configs[c]["device"] == "d"
    assert devices["e"] == theirs  # another device's entries, c4 included, are not touched


def test_the_writer_puts_entries_under_the_measuring_device(tmp_path):
    """``write_table`` files a sweep under the device kind that ran it: a new device gets its
    own entries beside the others' (the same class measured on both keeps both), a file is
    created in the layout the lookup reads, and a table of the old flat layout is refused."""
    from benchmarks.tune import SweepBest, config_key, write_table

    path = tmp_path / "table.json"
    cfg = {"block_k": 64}
    best = SweepBest(cfg, 0.3, True, frozenset({config_key(cfg)}))
    write_table(path, {"c1": (best, "S=128K")}, {"device": H100, "date": "then"})
    write_table(path, {"c1": (SweepBest({"block_k": 32}, 0.2, True, frozenset()), "S=128K"),
                       "c2": (best, "S=32K")}, {"device": H200, "date": "now"})
    table = json.loads(path.read_text())
    assert set(table) == {"about", "devices"} and set(table["devices"]) == {H100, H200}
    assert table["devices"][H100] == {"c1": {"config": cfg, "ms": 0.3, "measured_at": "S=128K", "device": H100,
                                             "date": "then"}}
    assert table["devices"][H200]["c1"]["config"] == {"block_k": 32} and set(table["devices"][H200]) == {"c1", "c2"}
    write_table(path, {}, {"device": "NVIDIA B200", "date": "now"})  # nothing measured: no empty device
    assert set(json.loads(path.read_text())["devices"]) == {H100, H200}

    flat = tmp_path / "flat.json"
    flat.write_text(json.dumps({"configs": {"c1": {"config": cfg}}}))
    with pytest.raises(SystemExit, match="old layout"):
        write_table(flat, {"c2": (best, "S=32K")}, {"device": H200, "date": "now"})
