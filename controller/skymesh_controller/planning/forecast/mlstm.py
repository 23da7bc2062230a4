"""PreServe's service workload predictor: a multiplicative LSTM over sliding windows.

The cell is Krause et al.'s mLSTM ("Multiplicative LSTM for sequence modelling", 2016,
arXiv:1609.07959, eqs. 18-22): an intermediate state ``m = (W_mx x) * (W_mh h)`` replaces
``h`` in the LSTM's gates and candidate, so each input picks its own recurrent transition.
PreServe (sec. 4.1, Alg. 1-2) feeds it the counts of the previous ``k`` windows, min-max
normalised, trains it to predict the next window, and online predicts two steps ahead
recursively: first the current (unfinished) window, then the next one from that
prediction. ``predict(h)`` does exactly this recursion for any ``h``.

torch is imported inside functions only, so ``import skymesh_controller.planning.forecast`` works on
an install without the ``forecast`` extra; constructing the network without torch fails
with a message naming the extra.

Parameters: ``lookback`` (k, 24 windows), ``hidden`` (32), ``epochs`` (60), ``refit_epochs``
(20: a retrain warm-starts from the current weights, PreServe's daily retraining; 0 trains
afresh), ``lr`` (0.003), ``batch`` (64), ``time_features`` (True: the time of day as
sin/cos inputs beside the count; False is PreServe's count-only input), ``residual``
(True: the head predicts the change from the last window), ``log`` (False: min-max
normalise log1p(y) instead of y), ``seed`` (0), ``progress`` (True: a tqdm bar per
training run on stderr).

Training and prediction run torch on one thread: the matrices are tiny and a step of the
recurrence is latency bound, so a second thread only adds synchronisation (measured here:
a fit twice as fast on one thread as on two).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from skymesh_controller.planning.forecast.base import Forecaster, clip_demand


def _torch() -> Any:
    try:
        import torch
    except ImportError as exc:  # the `forecast` extra is not installed
        raise RuntimeError("the mlstm forecaster needs torch: pip install 'skymesh[forecast]'") \
            from exc
    return torch


@contextmanager
def _one_thread(torch: Any) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def build_mlstm(input_size: int, hidden: int, residual: bool = True) -> Any:
    """An ``nn.Module`` mapping ``(batch, time, input_size)`` to ``(batch,)`` next values.

    With ``residual`` the head predicts the change from the last input value (feature 0),
    so an untrained network starts from persistence instead of from noise.
    """
    torch = _torch()
    nn = torch.nn

    class MLSTMCell(nn.Module):  # type: ignore[name-defined]
        """One mLSTM step (Krause et al. 2016, eqs. 18-22)."""

        def __init__(self) -> None:
            super().__init__()
            self.mx = nn.Linear(input_size, hidden, bias=False)
            self.mh = nn.Linear(hidden, hidden, bias=False)
            # The four projections from x and from m of (candidate, input, forget, output)
            # gates, stacked so one matmul each does them all.
            self.x4 = nn.Linear(input_size, 4 * hidden)
            self.m4 = nn.Linear(hidden, 4 * hidden, bias=False)
            with torch.no_grad():
                # Start the forget gate open, so early training keeps memory (standard LSTM
                # practice, Jozefowicz et al. 2015).
                self.x4.bias[2 * hidden:3 * hidden].fill_(1.0)

        def forward(self, x: Any, h: Any, c: Any) -> tuple[Any, Any]:
            m = self.mx(x) * self.mh(h)
            z = self.x4(x) + self.m4(m)
            cand, i, f, o = z.chunk(4, dim=-1)
            c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(cand)
            h = torch.tanh(c) * torch.sigmoid(o)
            return h, c

    class MLSTMRegressor(nn.Module):  # type: ignore[name-defined]
        def __init__(self) -> None:
            super().__init__()
            self.cell = MLSTMCell()
            self.head = nn.Linear(hidden, 1)

        def forward(self, seq: Any) -> Any:
            batch = seq.shape[0]
            h = seq.new_zeros(batch, hidden)
            c = seq.new_zeros(batch, hidden)
            for t in range(seq.shape[1]):
                h, c = self.cell(seq[:, t, :], h, c)
            out = self.head(h).squeeze(-1)
            return out + seq[:, -1, 0] if residual else out

    return MLSTMRegressor()


class MLSTMForecaster(Forecaster):
    name = "mlstm"

    def __init__(self, period: int, lookback: int = 24, hidden: int = 32, epochs: int = 60,
                 refit_epochs: int = 20, lr: float = 0.003, batch: int = 64,
                 time_features: bool = True, residual: bool = True, log: bool = False,
                 seed: int = 0,
                 progress: bool = True) -> None:
        super().__init__(period)
        for key, val in (("lookback", lookback), ("hidden", hidden), ("epochs", epochs),
                         ("batch", batch)):
            if int(val) < 1:
                raise ValueError(f"mlstm: {key} must be at least 1, got {val}")
        if refit_epochs < 0 or lr <= 0:
            raise ValueError("mlstm: refit_epochs must be >= 0 and lr > 0")
        self.lookback, self.hidden = int(lookback), int(hidden)
        self.epochs, self.refit_epochs = int(epochs), int(refit_epochs)
        self.lr, self.batch = float(lr), int(batch)
        self.time_features = bool(time_features)
        self.residual = bool(residual)
        self.log = bool(log)
        self.seed = int(seed)
        self.progress = bool(progress)
        self._net: Any = None
        self._lo = 0.0
        self._scale = 1.0
        self.fits = 0

    # -- features -------------------------------------------------------------------------
    def _norm(self, y: np.ndarray) -> np.ndarray:
        y = np.asarray(y, dtype=float)
        return ((np.log1p(np.maximum(y, 0.0)) if self.log else y) - self._lo) / self._scale

    def _denorm(self, z: np.ndarray) -> np.ndarray:
        y = np.asarray(z, dtype=float) * self._scale + self._lo
        return np.expm1(y) if self.log else y

    def _inputs(self, z: np.ndarray, first: int) -> np.ndarray:
        """Per-step input vectors for normalised values ``z`` whose first is history[first]."""
        if not self.time_features:
            return z[:, None]
        phase = 2.0 * np.pi * ((self.origin + first + np.arange(len(z))) % self.period) \
            / self.period
        return np.stack([z, np.sin(phase), np.cos(phase)], axis=1)

    @property
    def _input_size(self) -> int:
        return 3 if self.time_features else 1

    # -- training -------------------------------------------------------------------------
    def _fit(self) -> None:
        torch = _torch()
        y = self.history
        k = self.lookback
        if len(y) < k + 2:
            raise ValueError(f"mlstm: needs more than lookback + 1 = {k + 1} points, "
                             f"got {len(y)}")
        self._lo, self._scale = 0.0, 1.0
        raw = self._norm(y)
        self._lo = float(raw.min())
        self._scale = max(float(raw.max()) - self._lo, 1e-9)
        feats = self._inputs(self._norm(y), 0)
        n = len(y) - k
        # Sliding windows {y[i-k..i-1]} -> y[i], as PreServe's Alg. 1.
        idx = np.arange(n)[:, None] + np.arange(k)[None, :]
        x_all = torch.as_tensor(feats[idx], dtype=torch.float32)
        t_all = torch.as_tensor(self._norm(y[k:]), dtype=torch.float32)

        warm = self._net is not None and self.refit_epochs > 0
        epochs = self.refit_epochs if warm else self.epochs
        with torch.random.fork_rng(devices=[]), _one_thread(torch):
            torch.manual_seed(self.seed + self.fits)
            if not warm:
                self._net = build_mlstm(self._input_size, self.hidden, self.residual)
            net = self._net
            opt = torch.optim.Adam(net.parameters(), lr=self.lr)
            loss_fn = torch.nn.MSELoss()
            bar = self._bar(epochs)
            net.train()
            for _ in range(epochs):
                perm = torch.randperm(n)
                total = 0.0
                for s in range(0, n, self.batch):
                    b = perm[s:s + self.batch]
                    opt.zero_grad()
                    loss = loss_fn(net(x_all[b]), t_all[b])
                    loss.backward()
                    # Recurrent products can spike; clipping keeps a few bad windows from
                    # throwing the weights off.
                    torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
                    opt.step()
                    total += float(loss.detach()) * len(b)
                bar.set_postfix(mse=f"{total / n:.2e}", refresh=False)
                bar.update(1)
            bar.close()
            net.eval()
        self.fits += 1

    def _bar(self, epochs: int) -> Any:
        from tqdm import tqdm

        return tqdm(total=epochs, desc=f"mlstm fit {self.fits + 1}", unit="epoch",
                    file=sys.stderr, leave=False, disable=not self.progress)

    # -- prediction -----------------------------------------------------------------------
    def predict(self, h: int) -> np.ndarray:
        if self._net is None:
            raise RuntimeError("mlstm: fit before predict")
        torch = _torch()
        k = self.lookback
        first = len(self.history) - k
        z = list(self._norm(self.history[-k:]))
        out: list[float] = []
        with torch.no_grad(), _one_thread(torch):
            for step in range(h):
                feats = self._inputs(np.asarray(z[-k:]), first + step)
                x = torch.as_tensor(feats[None, :, :], dtype=torch.float32)
                nxt = float(self._net(x)[0])
                out.append(nxt)
                z.append(nxt)  # recursive: the prediction becomes input (PreServe Alg. 2)
        return clip_demand(self._denorm(np.asarray(out)))
