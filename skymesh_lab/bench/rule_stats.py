"""The pushing-rule grid's statistics: paired ratios over seeds, their geometric mean with
a Student's t interval over the logs, and the verdict from the intervals
(``skymesh_lab.bench.rule_grid``'s criterion; the page uses the same functions)."""

from __future__ import annotations

import math
import statistics

from scipy.stats import t as student_t

# The criterion (fixed before the verdict seeds ran). Per cell and seed, the rule's
# throughput over the better of bp's and sp-p's, and its P90 TTFT over the better one's;
# per cell, the geometric mean of those ratios over the seeds with its 95% interval
# (Student's t over the log ratios, the seeds paired: same workload for every system).
# A metric loses when its interval lies entirely beyond its bar (throughput below the
# floor, P90 above the ceiling), wins when it lies entirely on the good side, ties
# otherwise; the cell loses when either metric loses, wins when both win, ties otherwise.
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


def judge(thr: tuple[float, float], p90: tuple[float, float],
          floor: float = THROUGHPUT_FLOOR, ceiling: float = TTFT_P90_CEILING) -> str:
    """A cell's verdict from its two intervals (the criterion above)."""
    if thr[1] < floor or p90[0] > ceiling:
        return "loses"
    if thr[0] >= floor and p90[1] <= ceiling:
        return "wins"
    return "ties"
