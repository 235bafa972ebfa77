"""Kascade (anchor layers select, the layers after them reuse the selection), in one place:
the method (:mod:`.method`), its tile-sparse prefill (:mod:`.prefill`) and its calibration
(:mod:`.calibration`: anchor layers and head map from the similarity of top-k sets; the
command is ``python -m models.cli.kascade_calibrate``)."""

from sparse_jax.methods.kascade.method import ANCHOR, REUSE, Kascade, kascade_budget

__all__ = ["ANCHOR", "REUSE", "Kascade", "kascade_budget"]
