"""``skymesh predict train|eval``: the output-length predictors and their accuracy.

``train`` fits GoodServe's MoE-MLP (``--predictor wordvec``: the word-vector MLP of
:mod:`skymesh.predict.wordvec`) on the training split and saves it (default: the cache
file every user of the model loads, see :mod:`skymesh.predict.store`). ``eval`` scores the
MoE, the word-vector model (when its vectors are installed or its file exists) and the
history baseline on the test split, beside PreServe's Table 2, and writes
``{"predictors": {"moe-mlp": {...}, "wordvec-mlp": {...}, "history": {...}}}``.
``--limit N`` (hidden: for tests) uses N training and N/2 test samples and smaller,
quicker models.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from skymesh.predict.history import HistoryPredictor
from skymesh_lab.predict.data import Sample, limit
from skymesh_lab.predict.metrics import PRESERVE_TABLE2, accuracy

# ``skymesh bench --predictor``: the predictive benchmarks (goodput, preserve-router) read
# their length predictor from this variable, so the flag sets it for this process; the
# variable alone keeps working when the flag is absent. Same names as the benchmarks'.
PREDICTOR_ENV = "SKYMESH_LENGTH_PREDICTOR"
BENCH_PREDICTORS = ("moe", "wordvec", "noisy-oracle", "oracle", "history")


class PredictorFlag(argparse.Action):
    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        setattr(namespace, self.dest, values)
        os.environ[PREDICTOR_ENV] = str(values)


def _data(args: argparse.Namespace) -> tuple[list[Sample], list[Sample]]:
    from skymesh_lab.predict.models import default_split

    train, test = default_split()
    if args.limit is not None:
        if args.limit < 40:
            raise ValueError("--limit must be at least 40")
        train, test = limit(train, args.limit), limit(test, max(10, args.limit // 2))
    return train, test


def _config(args: argparse.Namespace) -> Any:
    from skymesh.predict.moe import MoEConfig

    if args.limit is None:
        return MoEConfig(seed=args.seed)
    return MoEConfig(seed=args.seed, max_features=1024, expert_hidden=(32, 16, 8),
                     gate_hidden=16, expert_epochs=4, gate_epochs=4, batch_size=64)


def _wordvec_config(args: argparse.Namespace) -> Any:
    from skymesh.predict.wordvec import WordVecConfig

    if args.limit is None:
        return WordVecConfig(seed=args.seed)
    return WordVecConfig(seed=args.seed, hidden=(64,), epochs=4, batch_size=64)


def history_predictions(train: list[Sample], test: list[Sample]) -> tuple[np.ndarray, float]:
    """The history baseline fed the training set, then predicting (and learning from) the
    test set in order, as a balancer would; returns predictions and ms per request."""
    h = HistoryPredictor()
    for s in train:
        h.observe(s.prompt_tokens + s.history_tokens, s.output_tokens)
    out = np.empty(len(test), dtype=np.int64)
    t0 = time.perf_counter()
    for i, s in enumerate(test):
        n = s.prompt_tokens + s.history_tokens
        out[i] = h.predict(n)
        h.observe(n, s.output_tokens)
    return out, (time.perf_counter() - t0) * 1000.0 / max(1, len(test))


def cmd_train(args: argparse.Namespace) -> int:
    if args.predictor == "wordvec":
        return _train_wordvec(args)
    from skymesh.predict.moe import train_moe
    from skymesh.predict.store import default_model_path

    train, _ = _data(args)
    model, report = train_moe(train, _config(args))
    out = Path(args.out) if args.out else default_model_path()
    model.save(out)
    print(f"trained on {report.samples} samples in {report.seconds:.1f} s "
          f"(experts' tier sizes {report.expert_samples}); saved {out}")
    if args.json:
        from skymesh.util.jsonio import write_json

        write_json(args.json, {"model": str(out), "samples": report.samples,
                               "expert_samples": report.expert_samples,
                               "train_seconds": report.seconds})
    return 0


def _train_wordvec(args: argparse.Namespace) -> int:
    from skymesh.predict.store import default_wordvec_path
    from skymesh.predict.wordvec import train_wordvec

    train, _ = _data(args)
    model, seconds = train_wordvec(train, _wordvec_config(args))
    out = Path(args.out) if args.out else default_wordvec_path()
    model.save(out)
    print(f"trained on {len(train)} samples in {seconds:.1f} s; saved {out}")
    if args.json:
        from skymesh.util.jsonio import write_json

        write_json(args.json, {"model": str(out), "samples": len(train),
                               "train_seconds": seconds})
    return 0


def _wordvec_model(args: argparse.Namespace, train: list[Sample]) -> Any:
    """The word-vector model to score, or None (with the reason on stderr) when neither a
    model file nor the vectors to train one are here."""
    from skymesh.predict.store import default_wordvec_path
    from skymesh.predict.wordvec import WordVecPredictor, package_dir, train_wordvec
    from skymesh_lab.predict.models import get_wordvec

    if args.wordvec_model:
        return WordVecPredictor.load(Path(args.wordvec_model))
    try:
        if args.limit is not None:
            package_dir()
            return train_wordvec(train, _wordvec_config(args))[0]
        if not default_wordvec_path().is_file():
            package_dir()
        return get_wordvec()
    except FileNotFoundError as exc:
        print(f"wordvec-mlp: skipped ({exc})", file=sys.stderr)
        return None


def evaluate(args: argparse.Namespace) -> dict[str, Any]:
    from skymesh.predict.moe import MoEPredictor, ms_per_request, train_moe
    from skymesh_lab.predict.models import get_moe

    train, test = _data(args)
    if args.model:
        model = MoEPredictor.load(Path(args.model))
    elif args.limit is not None:
        model, _ = train_moe(train, _config(args))
    else:
        model = get_moe()
    actual = np.array([s.output_tokens for s in test])
    preds = {"moe-mlp": model.predict(test)}
    res: dict[str, Any] = {"predictors": {
        "moe-mlp": {**accuracy(preds["moe-mlp"], actual),
                    "ms_per_request": ms_per_request(model, test)}}}
    wv = _wordvec_model(args, train)
    if wv is not None:
        from skymesh.predict import wordvec

        preds["wordvec-mlp"] = wv.predict(test)
        res["predictors"]["wordvec-mlp"] = {**accuracy(preds["wordvec-mlp"], actual),
                                            "ms_per_request": wordvec.ms_per_request(wv, test)}
    preds["history"], hist_ms = history_predictions(train, test)
    res["predictors"]["history"] = {**accuracy(preds["history"], actual),
                                    "ms_per_request": hist_ms}
    sources = sorted({s.source for s in test})
    res["by_source"] = {
        src: {name: accuracy(pred[mask], actual[mask]) for name, pred in preds.items()}
        for src in sources
        for mask in [np.array([s.source == src for s in test])]
    }
    res["samples"] = {"train": len(train), "test": len(test)}
    res["paper_preserve_table2"] = PRESERVE_TABLE2
    return res


def format_table(res: dict[str, Any]) -> str:
    rows = [(f"{name} (all)", r) for name, r in res["predictors"].items()]
    for src, by in res.get("by_source", {}).items():
        rows += [(f"{name} ({src})", r) for name, r in by.items()]
    rows.append(("PreServe, Table 2", PRESERVE_TABLE2))
    lines = [f"{'predictor':<24}{'MAE':>9}{'Acc-25':>9}{'Acc-50':>9}{'Acc-100':>9}{'ms/req':>9}"]
    for name, r in rows:
        ms = f"{r['ms_per_request']:>9.3f}" if "ms_per_request" in r else f"{'':>9}"
        lines.append(f"{name:<24}{r['mae_tokens']:>9.2f}{r['acc25'] * 100:>8.2f}%"
                     f"{r['acc50'] * 100:>8.2f}%{r['acc100'] * 100:>8.2f}%{ms}")
    return "\n".join(lines)


def cmd_eval(args: argparse.Namespace) -> int:
    res = evaluate(args)
    print(f"test samples: {res['samples']['test']} (train {res['samples']['train']})")
    print(format_table(res))
    from skymesh.util.jsonio import write_json

    write_json(args.json, res)
    return 0


def _guard(fn: Any) -> Any:
    def run(args: argparse.Namespace) -> int:
        try:
            return int(fn(args))
        except (ValueError, FileNotFoundError) as exc:
            print(f"skymesh predict: {exc}", file=sys.stderr)
            return 2
    return run


def register(sub: Any) -> None:
    pp = sub.add_parser("predict", help="output-length predictors: train, evaluate")
    psub = pp.add_subparsers(dest="predict_cmd", required=True)
    for name, fn, helptext in (("train", cmd_train, "train a length model (default MoE-MLP)"),
                               ("eval", cmd_eval, "accuracy beside PreServe's Table 2")):
        p = psub.add_parser(name, help=helptext)
        p.add_argument("--json", default=None, metavar="PATH")
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--limit", type=int, default=None, help=argparse.SUPPRESS)
        if name == "train":
            p.add_argument("--predictor", choices=("moe", "wordvec"), default="moe",
                           help="moe: GoodServe's MoE-MLP on TF-IDF; wordvec: an MLP on "
                                "pretrained word vectors (needs the predict extra)")
            p.add_argument("--out", default=None, metavar="PATH",
                           help="where to save the model (default: the cache file)")
        else:
            p.add_argument("--model", default=None, metavar="PATH",
                           help="a model file (default: the cached one, trained if missing)")
            p.add_argument("--wordvec-model", default=None, metavar="PATH",
                           help="a word-vector model file (default: the cached one, "
                                "trained if missing and the vectors are installed)")
        p.set_defaults(fn=_guard(fn))
