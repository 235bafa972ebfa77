"""benchmarks.kascade_bench's prefill part on CPU: bad method names fail before any model
is built; the TSA rows build the methods they name (the runs themselves need the GPU: an
8B-shaped model)."""

import pytest

from benchmarks import kascade_bench


def test_prefill_refuses_an_unknown_method_before_building_a_model(monkeypatch):
    monkeypatch.setattr("benchmarks.offload.random_model",
                        lambda *a, **k: pytest.fail("a model was built before the names were checked"))
    with pytest.raises(SystemExit, match="unknown prefill method 'nope'"):
        kascade_bench.main(["prefill", "--methods", "dense,nope", "--context", "256", "--layers", "1"])
    with pytest.raises(SystemExit):
        kascade_bench.main(["prefill", "--model", "gpt-2"])


def test_tsa_fraction_rows_build_token_sparse_methods(monkeypatch):
    built = []

    def fake_model(cfg, method, cap):
        built.append((cfg.name, cfg.num_layers, method.prefill, dict(method.prefill_options)))
        raise RuntimeError("stop")  # the timing itself needs the GPU

    monkeypatch.setattr("benchmarks.offload.random_model", fake_model)
    with pytest.raises(RuntimeError, match="stop"):
        kascade_bench.main(["prefill", "--methods", "tsa@0.25", "--model", "llama-3.1-8b", "--context", "256"])
    assert built == [("llama-3.1-8b", 32, "token_sparse", {"keep_fraction": 0.25})]


def _llama(context):
    import dataclasses

    from models.config import get_config

    return dataclasses.replace(get_config("llama-3.1-8b"), max_position=context)


def test_prefill_floor_counts_every_part():
    """The floor's FLOP, by hand for dense, and the sparse rows' attention below it by the
    pairs they skip (``floor_ms`` in the prefill table)."""
    from sparse_jax.methods import get_method

    s = 4096
    cfg = _llama(s)
    bound = lambda m: m.for_model(cfg.name, num_layers=cfg.num_layers, head_dim=cfg.head_dim)  # noqa: E731
    dense = kascade_bench.prefill_flops(cfg, bound(get_method("dense")), 2, s)
    h, d, L = cfg.num_heads, cfg.head_dim, cfg.num_layers
    assert dense["attention"] == pytest.approx(L * 4 * 2 * h * d * s * (s + 1) / 2)
    per_token = 2 * (4096 * (32 + 16) * 128 + 32 * 128 * 4096 + 3 * 4096 * 14336)
    assert dense["linear"] == pytest.approx(2 * (L * per_token * s + 2 * 4096 * cfg.vocab_size))
    assert dense["selection"] == 0

    half = kascade_bench.prefill_flops(
        cfg, bound(get_method("dense", prefill="token_sparse", prefill_options=(("keep_fraction", 0.5),))), 2, s)
    m = (s - 128) // 2 + 128  # half the prefix, and the window
    assert half["attention"] == pytest.approx(4 * 2 * h * d * (L // 2 * s * (s + 1) / 2 + L // 2 * m * (m + 1) / 2))
    assert half["linear"] == dense["linear"] and half["selection"] > 0
    assert kascade_bench.prefill_flops(cfg, bound(get_method("dense", prefill="token_sparse")), 2, s) is None

    kas = kascade_bench.prefill_flops(cfg, bound(get_method("kascade", tiled_prefill=True)), 2, s)
    # 31 of 32 layers attend about 10% of each prefix: far below dense, above the one dense anchor
    assert dense["attention"] / L < kas["attention"] < 0.2 * dense["attention"]
    assert kas["selection"] == pytest.approx(5 * 4 * 2 * h * d / 2 * s * (s + 1) / 2)
    # tiled_prefill_layers: the layers outside it attend densely (the selection is unchanged)
    none = kascade_bench.prefill_flops(cfg, bound(get_method("kascade", tiled_prefill=True,
                                                             tiled_prefill_layers=())), 2, s)
    assert none["attention"] == pytest.approx(dense["attention"]) and none["selection"] == kas["selection"]
    last = kascade_bench.prefill_flops(cfg, bound(get_method("kascade", tiled_prefill=True,
                                                             tiled_prefill_layers=(L - 1,))), 2, s)
    one_tiled = (kas["attention"] - dense["attention"] / L) / (L - 1)  # one tiled layer's share
    assert last["attention"] == pytest.approx(dense["attention"] * (L - 1) / L + one_tiled)
    # the composition: TSA's layers (the second half) attend their kept tokens, the first half
    # is tiled but for the dense first anchor, and both select
    both = kascade_bench.prefill_flops(cfg, bound(get_method("kascade", tiled_prefill=True, prefill="token_sparse",
                                                             prefill_options=(("keep_fraction", 0.5),))), 2, s)
    assert both["attention"] == pytest.approx(dense["attention"] / L + (L // 2 - 1) * one_tiled
                                              + 4 * 2 * h * d * L // 2 * m * (m + 1) / 2)
    assert both["selection"] == pytest.approx(kas["selection"] + half["selection"])


def test_prefill_method_names():
    """``prefill --methods``: Kascade's tiled prefill on some layers, composed with TSA,
    and bad names refused before any device work."""
    m = kascade_bench.prefill_method("kascade_tiled[18-35]+tsa@0.5", anchors=(0, 2))
    assert m.tiled_prefill and m.tiled_prefill_layers == tuple(range(18, 36)) and m.anchors == (0, 2)
    assert m.prefill == "token_sparse" and dict(m.prefill_options) == {"keep_fraction": 0.5}
    assert kascade_bench.prefill_method("kascade_tiled[5]").tiled_prefill_layers == (5,)
    assert kascade_bench.prefill_method("kascade_tiled+tsa").prefill_options == ()
    assert kascade_bench.prefill_method("tsa@0.25").name == "dense"
    assert kascade_bench.prefill_method("dense+tsa").prefill == "token_sparse"
    for bad in ("kascade", "tsa@x", "dense+quest", "kascade_tiled[a-b]", "kascade_tiled+", "kascade_tiled[3"):
        with pytest.raises(SystemExit, match="unknown prefill method"):
            kascade_bench.prefill_method(bad)


@pytest.mark.parametrize("part", ["attention", "e2e", "prefill"])
def test_each_part_runs_its_own_rows(part, monkeypatch):
    """``main`` sends each part to its own rows (the runs need the GPU: recorded here)."""
    called = []
    for fn in ("attention_rows", "e2e_rows", "prefill_rows"):
        monkeypatch.setattr(kascade_bench, fn, lambda *a, fn=fn, **k: called.append(fn) or [{"method": "m"}])
    kascade_bench.main([part] + (["--shapes", "1x256"] if part == "attention" else []))
    assert called == [f"{part}_rows"]
