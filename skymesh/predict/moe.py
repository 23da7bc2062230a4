"""GoodServe's mixture-of-experts output-length predictor (sec. 3.2, Fig. 4), in torch.

Features: TF-IDF of the prompt text (scikit-learn's ``TfidfVectorizer``, vocabulary capped
at ``max_features`` words, sublinear term frequency) plus two length features
(log prompt and log history tokens, scaled to about [0, 1]). Model: a gating router, a
two-layer MLP giving a softmax over ``K`` experts, and ``K`` experts, four-layer MLPs each
predicting the length; the prediction is the gate-weighted sum of the experts' outputs.

Training, in GoodServe's two phases:

1. the training set is shuffled (seeded) and halved; on the first half, prompt length
   (prompt + history tokens) and output length are each cut into ``sqrt(K)`` tiers at
   their quantiles, and expert ``k = 3 x input tier + output tier`` (for K = 9) is trained
   alone on its tier's samples;
2. with the experts frozen, the gate is trained on the second half, on the loss of the
   weighted prediction.

Both phases minimise the L1 error (the MAE that PreServe's Table 2 and GoodServe's Fig. 8
report), on lengths divided by ``SCALE``. Inputs are sparse end to end (``torch.sparse``
products), so a batch costs what its non-zero features cost, not the vocabulary size.

torch is imported only inside the functions that train, load or run the model, so the
balancer and the simulator import this package without it.
"""

from __future__ import annotations

import itertools
import math
import pickle
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from skymesh.predict.sample import MAX_TOKENS, Sample

if TYPE_CHECKING:
    import scipy.sparse as sp
    import torch
    from sklearn.feature_extraction.text import TfidfVectorizer

SCALE = 256.0  # lengths are learnt in units of this many tokens
FORMAT = 1


@dataclass(frozen=True)
class MoEConfig:
    experts: int = 9  # GoodServe's K; a perfect square (sqrt(K) tiers per length)
    max_features: int = 4096
    expert_hidden: tuple[int, ...] = (128, 64, 32)  # three hidden layers: four linear
    gate_hidden: int = 64
    expert_epochs: int = 8
    gate_epochs: int = 6
    batch_size: int = 256
    lr: float = 2e-3
    seed: int = 0
    threads: int = 2

    def __post_init__(self) -> None:
        tiers = math.isqrt(self.experts)
        if self.experts < 1 or tiers * tiers != self.experts:
            raise ValueError(f"experts must be a perfect square >= 1, got {self.experts}")
        if self.max_features < 16 or self.batch_size < 1 or self.lr <= 0:
            raise ValueError("need max_features >= 16, batch_size >= 1, lr > 0")
        if self.expert_epochs < 1 or self.gate_epochs < 1:
            raise ValueError("epochs must be >= 1")


@dataclass
class TrainReport:
    samples: int
    expert_samples: list[int] = field(default_factory=list)
    seconds: float = 0.0


def _length_features(samples: list[Sample]) -> np.ndarray:
    return np.array([[math.log1p(s.prompt_tokens) / 8.0, math.log1p(s.history_tokens) / 10.0]
                     for s in samples], dtype=np.float32)


def _new_vectorizer(max_features: int, vocabulary: dict[str, int] | None = None
                    ) -> TfidfVectorizer:
    from sklearn.feature_extraction.text import TfidfVectorizer

    return TfidfVectorizer(max_features=max_features, sublinear_tf=True,
                           min_df=2 if vocabulary is None else 1, dtype=np.float32,
                           vocabulary=vocabulary)


def _bags(x: sp.csr_matrix) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A CSR batch as EmbeddingBag inputs (indices, offsets, weights): ``x @ W`` for a
    sparse ``x`` is a weighted sum of the rows of ``W`` its non-zeros pick."""
    import torch

    return (torch.from_numpy(x.indices.astype(np.int64)),
            torch.from_numpy(x.indptr[:-1].astype(np.int64)),
            torch.from_numpy(x.data.astype(np.float32)))


def _net(n_text: int, hidden: tuple[int, ...], n_out: int) -> Any:
    """An MLP whose first layer takes sparse text features (an EmbeddingBag, mode sum) and
    the dense length features; ``len(hidden) + 1`` linear layers in all."""
    import torch.nn as nn

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.text = nn.EmbeddingBag(n_text, hidden[0], mode="sum", sparse=True)
            nn.init.normal_(self.text.weight, std=n_text ** -0.5)
            self.lengths = nn.Linear(2, hidden[0])
            layers: list[nn.Module] = []
            for a, b in itertools.pairwise(hidden):
                layers += [nn.ReLU(), nn.Linear(a, b)]
            layers += [nn.ReLU(), nn.Linear(hidden[-1], n_out)]
            self.rest = nn.Sequential(*layers)

        def forward(self, bags: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                    lengths: torch.Tensor) -> torch.Tensor:
            idx, off, w = bags
            h = self.text(idx, off, per_sample_weights=w) + self.lengths(lengths)
            return self.rest(h)

        @property
        def out_bias(self) -> Any:
            return self.rest[-1].bias

    return Net()


Features = tuple["sp.csr_matrix", np.ndarray]  # TF-IDF rows, length features


class MoEPredictor:
    """A trained model: ``predict`` for a batch, ``predict_one`` for the request path.

    At inference the K experts run as one stacked network: their first layers are one
    EmbeddingBag of K x hidden columns (plus the gate's), the later layers batched matrix
    products, so a request costs a handful of small torch calls however large K is.
    """

    def __init__(self, vectorizer: TfidfVectorizer, experts: list[Any], gate: Any,
                 config: MoEConfig) -> None:
        self.vectorizer = vectorizer
        self.experts = experts
        self.gate = gate
        self.config = config
        self._stack: list[Any] | None = None
        self._one: tuple[Any, dict[str, int], np.ndarray] | None = None

    def features(self, samples: list[Sample]) -> Features:
        return self.vectorizer.transform([s.text for s in samples]), _length_features(samples)

    def _stacked(self) -> list[Any]:
        import torch

        if self._stack is None:
            with torch.no_grad():
                nets = [*self.experts, self.gate]
                first = torch.cat([n.text.weight for n in nets], dim=1)
                len_w = torch.cat([n.lengths.weight for n in nets], dim=0).t()
                len_b = torch.cat([n.lengths.bias for n in nets])
                layers = []
                linear = [[m for m in e.rest if isinstance(m, torch.nn.Linear)]
                          for e in self.experts]
                for j in range(len(linear[0])):
                    w = torch.stack([lin[j].weight.t() for lin in linear])  # K, in, out
                    b = torch.stack([lin[j].bias for lin in linear])  # K, out
                    layers.append((w, b))
                gate_out = self.gate.rest[-1]
            self._stack = [first, len_w, len_b, layers, gate_out.weight.t(), gate_out.bias]
            for m in nets:
                m.eval()
        return self._stack

    def text_bag(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        """One text's TF-IDF row as (columns, weights): what ``vectorizer.transform`` gives
        (sublinear tf x idf, L2-normalised), without its per-call overhead, which is most
        of a single request's prediction time (about 0.5 of 1.2 ms measured)."""
        if self._one is None:
            v = self.vectorizer
            self._one = (v.build_analyzer(), v.vocabulary_,
                         np.asarray(v.idf_, dtype=np.float32))
        analyze, vocab, idf = self._one
        counts: dict[int, int] = {}
        for term in analyze(text):
            j = vocab.get(term)
            if j is not None:
                counts[j] = counts.get(j, 0) + 1
        cols = np.fromiter(sorted(counts), dtype=np.int64, count=len(counts))
        tf = np.fromiter((counts[j] for j in cols), dtype=np.float32, count=len(cols))
        w = (np.log(tf) + np.float32(1.0)) * idf[cols]
        norm = np.sqrt(np.dot(w, w))
        return cols, (w / norm if norm > 0 else w)

    def _predict_x(self, x: Features) -> np.ndarray:
        return self._predict_bags(_bags(x[0]), x[1])

    def _predict_bags(self, bags: tuple[Any, Any, Any], lengths: np.ndarray) -> np.ndarray:
        import torch
        import torch.nn.functional as F

        first, len_w, len_b, layers, gate_w, gate_b = self._stacked()
        k, h = self.config.experts, self.config.expert_hidden[0]
        with torch.no_grad():
            idx, off, w = bags
            z = F.embedding_bag(idx, first, off, mode="sum", per_sample_weights=w)
            z = z + torch.from_numpy(lengths) @ len_w + len_b
            hx = torch.relu(z[:, : k * h]).reshape(-1, k, h).transpose(0, 1)  # K, B, h
            for j, (wj, bj) in enumerate(layers):
                hx = torch.baddbmm(bj.unsqueeze(1), hx, wj)
                if j < len(layers) - 1:
                    hx = torch.relu(hx)
            gate = torch.softmax(torch.relu(z[:, k * h:]) @ gate_w + gate_b, dim=1)  # B, K
            y = (gate * hx[:, :, 0].t()).sum(dim=1) * SCALE
        return np.clip(np.rint(y.numpy()), 1, MAX_TOKENS).astype(np.int64)

    def predict(self, samples: list[Sample], batch_size: int = 4096) -> np.ndarray:
        out = [self._predict_x(self.features(samples[i:i + batch_size]))
               for i in range(0, len(samples), batch_size)]
        return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)

    def predict_one(self, text: str, prompt_tokens: int, history_tokens: int = 0) -> int:
        import torch

        cols, w = self.text_bag(text)
        bags = (torch.from_numpy(cols), torch.zeros(1, dtype=torch.int64),
                torch.from_numpy(w.astype(np.float32, copy=False)))
        s = Sample(text, prompt_tokens, history_tokens, 1, "", "")
        return int(self._predict_bags(bags, _length_features([s]))[0])

    # -- persistence -----------------------------------------------------------------------
    def save(self, path: Path) -> None:
        import torch

        vocab = self.vectorizer.vocabulary_
        terms = [""] * len(vocab)
        for term, i in vocab.items():
            terms[i] = term
        blob = {
            "format": FORMAT,
            "config": {k: list(v) if isinstance(v, tuple) else v
                       for k, v in asdict(self.config).items()},
            "terms": terms,
            "idf": torch.from_numpy(np.asarray(self.vectorizer.idf_, dtype=np.float32)),
            "experts": [e.state_dict() for e in self.experts],
            "gate": self.gate.state_dict(),
        }
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".tmp")
        torch.save(blob, tmp)
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path) -> MoEPredictor:
        import torch

        try:
            blob = torch.load(path, weights_only=True)
        except (OSError, RuntimeError, EOFError, pickle.UnpicklingError) as exc:
            raise ValueError(f"cannot read length model {path}: {exc}") from None
        if not isinstance(blob, dict) or blob.get("format") != FORMAT:
            raise ValueError(f"{path} is not a SkyMesh length model (format {FORMAT})")
        raw = dict(blob["config"])
        raw["expert_hidden"] = tuple(raw["expert_hidden"])
        config = MoEConfig(**raw)
        terms: list[str] = blob["terms"]
        vec = _new_vectorizer(config.max_features, {t: i for i, t in enumerate(terms)})
        vec.fit(terms[:1])  # validates the fixed vocabulary; idf is replaced below
        vec.idf_ = blob["idf"].numpy()
        experts = [_net(len(terms), config.expert_hidden, 1) for _ in range(config.experts)]
        for e, state in zip(experts, blob["experts"], strict=True):
            e.load_state_dict(state)
        gate = _net(len(terms), (config.gate_hidden,), config.experts)
        gate.load_state_dict(blob["gate"])
        return cls(vec, experts, gate, config)


def _tiers(values: np.ndarray, n: int) -> np.ndarray:
    edges = np.quantile(values, [i / n for i in range(1, n)])
    return np.searchsorted(edges, values, side="right")


def _fit(net: Any, x: Features, epochs: int, cfg: MoEConfig, gen: Any, loss_of: Any) -> None:
    import torch

    net.train()
    # The text layer's gradient touches only the rows a batch's words pick: a sparse
    # optimiser for it keeps a step's cost proportional to the batch, not the vocabulary.
    dense = [p for n, p in net.named_parameters() if not n.startswith("text.")]
    opts = [torch.optim.SparseAdam(list(net.text.parameters()), lr=cfg.lr),
            torch.optim.Adam(dense, lr=cfg.lr)]
    text, lengths = x
    n = text.shape[0]
    for _ in range(epochs):
        order = torch.randperm(n, generator=gen).numpy()
        for i in range(0, n, cfg.batch_size):
            idx = order[i:i + cfg.batch_size]
            out = net(_bags(text[idx]), torch.from_numpy(lengths[idx]))
            loss = loss_of(out, idx)
            for opt in opts:
                opt.zero_grad()
            loss.backward()
            for opt in opts:
                opt.step()
    net.eval()


def train_moe(train: list[Sample], config: MoEConfig | None = None,
              log: Any = None) -> tuple[MoEPredictor, TrainReport]:
    """Fit the vectorizer and both phases on ``train`` (deterministic for a config)."""
    import torch

    cfg = config or MoEConfig()
    if len(train) < 4 * cfg.experts:
        raise ValueError(f"need at least {4 * cfg.experts} training samples, got {len(train)}")
    t0 = time.perf_counter()
    torch.manual_seed(cfg.seed)
    old_threads = torch.get_num_threads()
    torch.set_num_threads(cfg.threads)
    try:
        order = np.random.default_rng(cfg.seed).permutation(len(train))
        half = len(train) // 2
        a = [train[i] for i in order[:half]]
        b = [train[i] for i in order[half:]]
        vec = _new_vectorizer(cfg.max_features)
        vec.fit([s.text for s in train])
        tiers = math.isqrt(cfg.experts)
        n_text = len(vec.vocabulary_)
        experts = [_net(n_text, cfg.expert_hidden, 1) for _ in range(cfg.experts)]
        gate = _net(n_text, (cfg.gate_hidden,), cfg.experts)
        model = MoEPredictor(vec, experts, gate, cfg)
        gen = torch.Generator().manual_seed(cfg.seed)

        # Phase 1: each expert alone on its (input tier, output tier) share of half A.
        xa = model.features(a)
        ya = np.array([s.output_tokens for s in a], dtype=np.float32)
        tier = (_tiers(np.array([s.prompt_tokens + s.history_tokens for s in a], float), tiers)
                * tiers + _tiers(ya, tiers))
        report = TrainReport(samples=len(train))
        for k, expert in enumerate(experts):
            rows = np.flatnonzero(tier == k)
            report.expert_samples.append(int(rows.size))
            if not rows.size:
                continue
            y = torch.from_numpy(ya[rows] / SCALE)
            with torch.no_grad():  # start from the tier's median: fewer epochs to converge
                expert.out_bias.fill_(float(y.median()))

            def l1(out: torch.Tensor, idx: np.ndarray, y: torch.Tensor = y) -> torch.Tensor:
                return (out[:, 0] - y[idx]).abs().mean()

            _fit(expert, (xa[0][rows], xa[1][rows]), cfg.expert_epochs, cfg, gen, l1)
            if log:
                log(f"expert {k}: {rows.size} samples")
        # Phase 2: the gate on half B, experts frozen (their outputs computed once).
        xb = model.features(b)
        yb = torch.from_numpy(np.array([s.output_tokens for s in b], dtype=np.float32) / SCALE)
        with torch.no_grad():
            bags, lens = _bags(xb[0]), torch.from_numpy(xb[1])
            eb = torch.cat([e(bags, lens) for e in experts], dim=1)

        def gated_l1(logits: torch.Tensor, idx: np.ndarray) -> torch.Tensor:
            w = torch.softmax(logits, dim=1)
            return ((w * eb[idx]).sum(dim=1) - yb[idx]).abs().mean()

        _fit(gate, xb, cfg.gate_epochs, cfg, gen, gated_l1)
    finally:
        torch.set_num_threads(old_threads)
    report.seconds = time.perf_counter() - t0
    return model, report


def ms_per_request(model: MoEPredictor, samples: list[Sample], n: int = 300) -> float:
    """Mean wall time of ``predict_one`` on one thread (the request path)."""
    import torch

    if not samples:
        raise ValueError("need samples to time")
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        picks = [samples[i % len(samples)] for i in range(n)]
        model.predict_one(picks[0].text, picks[0].prompt_tokens)  # warm up
        t0 = time.perf_counter()
        for s in picks:
            model.predict_one(s.text, s.prompt_tokens, s.history_tokens)
        return (time.perf_counter() - t0) * 1000.0 / n
    finally:
        torch.set_num_threads(old)
