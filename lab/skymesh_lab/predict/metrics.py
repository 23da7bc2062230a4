"""Accuracy of length predictions as PreServe's Table 2 reports it (sec. 5.2.2): the mean
absolute error in tokens, and Acc-N, the share of predictions within N tokens of the truth
(as a fraction: 0.6879 = 68.79%)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

# PreServe, Table 2 (ShareGPT, 7:3 split, DistilBERT-based predictor).
PRESERVE_TABLE2 = {"mae_tokens": 78.25, "acc25": 0.5677, "acc50": 0.6879, "acc100": 0.7795}


def accuracy(predicted: Sequence[float] | npt.NDArray[np.generic],
             actual: Sequence[float] | npt.NDArray[np.generic]) -> dict[str, float]:
    p = np.asarray(predicted, dtype=float)
    a = np.asarray(actual, dtype=float)
    if p.shape != a.shape or p.size == 0:
        raise ValueError("need equally many (and some) predictions and actual lengths")
    err = np.abs(p - a)
    return {
        "mae_tokens": float(err.mean()),
        "acc25": float((err <= 25).mean()),
        "acc50": float((err <= 50).mean()),
        "acc100": float((err <= 100).mean()),
    }
