"""The pushing-rule grid's statistics: paired ratios over seeds, their geometric mean with
a Student's t interval over the logs, and the verdict from the intervals
(``skymesh_lab.bench.rule_grid``'s criteria; the page uses the same functions).

Two criteria, both with the same interval, bars and verdict; they differ only in what the
rule is held against.

1. Per seed (fixed before seeds 7-14 ran): on each seed, the better of bp and sp-p on that
   seed. Where bp and sp-p are equal within noise, the per-seed better of two noisy P90s
   is biased low (the minimum of two draws), so a rule equal to both shows a ratio above
   1 on most seeds.
2. Per cell (fixed before seeds 15-22 ran, issue #24 item 4): the comparator is chosen
   ONCE per cell and metric, as whichever of bp and sp-p has the better geometric mean
   over the cell's seeds (higher throughput; lower P90 TTFT; bp on an exact tie); the
   rule's paired per-seed ratios to that one system then give the geometric mean and 95%
   interval, judged against the same bars. The throughput and the P90 comparators may
   differ. One choice per cell over all seeds is a minimum of two means, not of two
   draws per seed, so its bias shrinks as seeds are added.
"""

from __future__ import annotations

import math
import statistics

from scipy.stats import t as student_t

# The first criterion (fixed before seeds 7-14 ran). Per cell and seed, the rule's
# throughput over the better of bp's and sp-p's, and its P90 TTFT over the better one's;
# per cell, the geometric mean of those ratios over the seeds with its 95% interval
# (Student's t over the log ratios, the seeds paired: same workload for every system).
# A metric loses when its interval lies entirely beyond its bar (throughput below the
# floor, P90 above the ceiling), wins when it lies entirely on the good side, ties
# otherwise; the cell loses when either metric loses, wins when both win, ties otherwise.
# The second criterion (docstring) keeps all of this but the comparator.
THROUGHPUT_FLOOR = 0.99
TTFT_P90_CEILING = 1.0
CONFIDENCE = 0.95


def gmean(xs: list[float]) -> float:
    return math.exp(statistics.fmean(math.log(x) for x in xs))


def interval(xs: list[float], level: float = CONFIDENCE) -> tuple[float, float]:
    """The ``level`` interval of the geometric mean of paired ratios: Student's t over
    their logs (the seeds are the samples). Fewer than two seeds: unbounded."""
    if len(xs) < 2:
        return 0.0, math.inf
    logs = [math.log(x) for x in xs]
    m, sd = statistics.fmean(logs), statistics.stdev(logs)
    h = float(student_t.ppf(0.5 + level / 2, len(xs) - 1)) * sd / math.sqrt(len(xs))
    return math.exp(m - h), math.exp(m + h)


def comparator(bp: list[float], sp_p: list[float], higher_is_better: bool) -> str:
    """The second criterion's one comparator for a cell and metric: ``"bp"`` or ``"sp-p"``,
    whichever has the better geometric mean over the seeds (``"bp"`` on an exact tie)."""
    g_bp, g_sp = gmean(bp), gmean(sp_p)
    better = g_sp > g_bp if higher_is_better else g_sp < g_bp
    return "sp-p" if better else "bp"


def judge(thr: tuple[float, float], p90: tuple[float, float],
          floor: float = THROUGHPUT_FLOOR, ceiling: float = TTFT_P90_CEILING) -> str:
    """A cell's verdict from its two intervals (the criterion above)."""
    if thr[1] < floor or p90[0] > ceiling:
        return "loses"
    if thr[0] >= floor and p90[1] <= ceiling:
        return "wins"
    return "ties"
