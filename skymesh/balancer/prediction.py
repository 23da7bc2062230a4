"""Output-length prediction in the live balancer, for policies that read
``RouteRequest.predicted_output_tokens`` (``Policy.uses_length_prediction``).

``prediction.predictor: moe`` (default) loads GoodServe's MoE-MLP (``skymesh.predict``),
``wordvec`` the word-vector MLP (:mod:`skymesh.predict.wordvec`), at start-up in a worker
thread, so the event loop serves from the first moment; until the
model is in memory, and for good when its file is missing or unreadable, the history
predictor answers (median of recent outputs per prompt-length bucket, fed by this
balancer's own completions) and the log says why.

Why not train a missing model here: training takes about 90 s of both cores on this
class of machine. Blocking start-up on it would keep a balancer (and its region) down for
minutes after a restart; training in a background thread would take the CPU the event
loop needs just as traffic arrives (the GIL, and torch's own threads). A model is a
build artefact: ``skymesh predict train`` makes it once, every balancer then loads it.

A prediction runs inline on the event loop (about 0.5-1 ms for the MoE, torch on one
thread; 0.2-0.4 ms for the word-vector model, numpy): cheap next to a request's lifetime,
and only for the policies that use it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from skymesh.balancer.config import PredictionConfig
from skymesh.predict.history import HistoryPredictor

log = logging.getLogger("skymesh.lb.prediction")


class LengthModel(Protocol):
    def predict_one(self, text: str, prompt_tokens: int, history_tokens: int = 0) -> int: ...


def load_moe(path: Path) -> LengthModel:
    """Load the MoE model (in a worker thread) and run it once: the first call pays for
    lazy initialisation (tens of ms) that must not land on a request."""
    import torch

    from skymesh.predict.moe import MoEPredictor

    # One intra-op thread: the model is tiny, and more threads would compete with the
    # event loop for the machine's cores on every prediction.
    torch.set_num_threads(1)
    model = MoEPredictor.load(path)
    model.predict_one("warm up", 2, 0)
    return model


def load_wordvec(path: Path) -> LengthModel:
    """Load the word-vector model (numpy and the tokenizer; no torch) and run it once."""
    from skymesh.predict.wordvec import WordVecPredictor

    model = WordVecPredictor.load(path)
    model.predict_one("warm up", 2, 0)
    return model


LOADERS: dict[str, Callable[[Path], LengthModel]] = {"moe": load_moe, "wordvec": load_wordvec}


class LivePredictor:
    def __init__(self, cfg: PredictionConfig,
                 loader: Callable[[Path], LengthModel] | None = None) -> None:
        self.cfg = cfg
        self._loader = loader or LOADERS.get(cfg.predictor, load_moe)
        self.history = HistoryPredictor()
        self.model: LengthModel | None = None
        self.error: str | None = None
        self.predictions = 0
        self._task: asyncio.Task[None] | None = None

    @property
    def active(self) -> str:
        """What answers right now: "moe", "wordvec", "history" or "none"."""
        if self.cfg.predictor == "none":
            return "none"
        return self.cfg.predictor if self.model is not None else "history"

    def model_path(self) -> Path:
        if self.cfg.model_path:
            return Path(self.cfg.model_path).expanduser()
        from skymesh.predict.store import default_model_path, default_wordvec_path

        return default_wordvec_path() if self.cfg.predictor == "wordvec" else \
            default_model_path()

    def start(self) -> None:
        """Begin loading the model, if configured; returns at once (idempotent)."""
        if (self.cfg.predictor not in LOADERS or self._task is not None
                or self.model is not None):
            return
        self._task = asyncio.get_running_loop().create_task(self._load(),
                                                            name="skymesh-length-model")

    async def wait_loaded(self) -> None:
        if self._task is not None:
            await asyncio.shield(self._task)

    async def _load(self) -> None:
        path = self.model_path()
        if not path.is_file():
            self.error = f"{path} not found"
            flag = " --predictor wordvec" if self.cfg.predictor == "wordvec" else ""
            log.warning("length model %s not found: predicting with the history baseline "
                        "(run `skymesh predict train%s` once to create it, then restart)",
                        path, flag)
            return
        try:
            self.model = await asyncio.to_thread(self._loader, path)
        except Exception as exc:  # a bad file must not take the balancer down
            self.error = str(exc) or type(exc).__name__
            log.warning("length model %s not usable (%s): predicting with the history "
                        "baseline", path, self.error)
            return
        log.info("length model %s loaded", path)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def predict(self, text: str, prompt_tokens: int, history_tokens: int, prompt_len: int,
                max_tokens: int | None) -> int | None:
        """Predicted output tokens (at most ``max_tokens``: the engine stops there), or
        None with ``predictor: none``."""
        kind = self.cfg.predictor
        if kind == "none":
            return None
        model = self.model
        if model is not None:
            out = model.predict_one(text, prompt_tokens, history_tokens)
        else:
            out = self.history.predict(prompt_len)
        self.predictions += 1
        out = max(1, int(out))
        return min(out, max_tokens) if max_tokens else out

    def observe(self, prompt_len: int, output_tokens: int) -> None:
        """A completed request's output length (feeds the history baseline)."""
        if output_tokens > 0 and self.cfg.predictor != "none":
            self.history.observe(prompt_len, output_tokens)

    def status(self) -> dict[str, Any]:
        return {"predictor": self.cfg.predictor, "active": self.active,
                "predictions": self.predictions, "error": self.error}
