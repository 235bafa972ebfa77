"""The selection-cause probe (``benchmarks/probes/selection_cause.py``) in its ``--tiny`` mode: a
random 4-layer model, AsyncSpade over its token selector and Kascade, two fake-needle prompts.
What must hold whatever the weights: no budget-sized selection holds more dense mass than the
oracle top-k; Kascade's exact anchors keep exactly what the oracle keeps; AsyncSpade's token
selection is the probe's own top-k of the predicted query; the files are written."""

from __future__ import annotations

import json

import numpy as np
import pytest

from benchmarks.probes import selection_cause as sc


def test_tiny_mode_records_consistent_selections(tmp_path):
    assert sc.main(["--tiny", "--methods", "asyncspade,kascade", "--set", "asyncspade.selector=oracle_topk",
                    "--steps", "3", "--no-progress", "--out", str(tmp_path), "--name", "sc"]) == 0
    payload = json.loads((tmp_path / "sc.json").read_text())
    assert (tmp_path / "sc.md").read_text().startswith("# Selection-cause probe")
    assert payload["prompts"] == ["tiny/0", "tiny/1"] and payload["budget"] == 32
    spade, kas = payload["methods"]
    assert spade["variants"] == list(sc.COMMON + sc.SPADE) and kas["variants"] == list(sc.COMMON + sc.KASCADE)
    # AsyncSpade runs on layers 2-3 (0, 1 dense), Kascade on all 4; 2 prompts x 3 steps each
    assert sorted({r["layer"] for r in spade["rows"]}) == [2, 3] and len(spade["rows"]) == 2 * 3 * 2
    assert sorted({r["layer"] for r in kas["rows"]}) == [0, 1, 2, 3] and len(kas["rows"]) == 2 * 3 * 4
    for m in (spade, kas):
        for r in m["rows"]:
            assert 0 < r["share"] < 1 and r["needle_mass"] > 0
            for v in m["variants"]:
                assert -1e-6 <= r[f"kept_{v}"] <= r["needle_mass"] + 1e-6
                if not (m is kas and v in ("method", "reuse_identity") and r["layer"] == 0):  # the dense anchor
                    assert r[f"recall_{v}"] <= r["recall_oracle_tok"] + 1e-5, (m["name"], v, r)
    for r in spade["rows"]:
        # the token selector attends the top-(budget - 1) of the predicted query + the new token
        assert r["kept_method"] == pytest.approx(r["kept_pred_tok"], abs=1e-6)
        assert r["recall_method"] == pytest.approx(r["recall_pred_tok"], abs=1e-6)
        assert -1 <= r["cos"] <= 1 and 0 <= r["overlap"] <= 1
        if r["step"] == 0:  # one known query: the prediction is the lag
            assert r["cos"] == pytest.approx(r["cos_lag"], abs=1e-6)
            assert r["kept_pred_tok"] == pytest.approx(r["kept_lag_tok"], abs=1e-6)
    roles = {r["layer"]: r.get("role") for r in kas["by_layer"] if r["layer"] != "all"}
    assert roles == {0: "dense anchor", 1: "reuse<-0", 2: "anchor", 3: "reuse<-2"}
    for r in kas["rows"]:
        if r["layer"] == 2:  # an exact anchor is the oracle top-k
            assert r["kept_method"] == pytest.approx(r["kept_oracle_tok"], abs=1e-6)
        if r["layer"] == 0:
            assert r["kept_method"] == pytest.approx(r["needle_mass"], rel=1e-6)
        assert r["kept_reuse_identity"] == pytest.approx(r["kept_method"], abs=1e-6)  # no head map: identity
    assert [r["step"] for r in spade["by_step"][:-1]] == [0, 1, 2] or spade["by_step"] == []


def test_step_metrics_by_hand():
    # 1 KV head, 2 query heads, 6 positions; the needle is positions 2-3
    probs = np.array([[[0.1, 0.1, 0.5, 0.2, 0.1, 0.0], [0.3, 0.0, 0.1, 0.1, 0.5, 0.0]]])
    masks = np.zeros((3, 1, 6), bool)
    masks[0, 0, [2, 4]] = True
    masks[1, 0, [3]] = True
    masks[2, 0, :] = True
    m = sc.step_metrics(probs, masks, np.array([2, 3]), ("oracle_tok", "x", "all"))
    assert m["needle_mass"] == pytest.approx(0.9) and m["share"] == pytest.approx(0.45)
    assert m["kept_oracle_tok"] == pytest.approx(0.6) and m["kept_x"] == pytest.approx(0.3)
    assert m["kept_all"] == pytest.approx(0.9)
    assert m["recall_oracle_tok"] == pytest.approx((0.6 + 0.6) / 2) and m["recall_all"] == pytest.approx(1.0)
