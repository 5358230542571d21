"""Is a system still warming up? A trend test on its measured step times.

A mean over measured steps is only a steady-state number if those steps no longer get faster (or
slower). For the ``n`` measured step times ``t_0 .. t_(n-1)`` with mean ``m``:

- ``slope``: the least-squares slope of ``t_i`` against ``i``, relative to ``m`` (per step);
- ``halves``: (mean of the last ``n // 2`` steps - mean of the first ``n // 2``) / ``m``.

A system is flagged when ``|slope| > 1 %`` per step OR ``|halves| > 3 %`` (``SLOPE_LIMIT``,
``HALVES_LIMIT``), and only with at least 3 measured steps (``MIN_STEPS``: with two, a slope is
one difference and cannot tell a trend from noise; such a run is reported "not assessed").
The slope catches a steady drift in short runs, the halves a drift that is slow per step but
adds up over a long run. At a step-to-step noise of 1 %, four steps give the slope a standard
error of 0.45 %/step, so the 1 % limit is about two standard errors. Getting faster reads "still
warming up" (raise ``--warmup-steps``); getting slower reads "slowing down".
"""

from __future__ import annotations

import statistics
from typing import Any

SLOPE_LIMIT = 0.01
HALVES_LIMIT = 0.03
MIN_STEPS = 3

RULE = (f"flagged when the least-squares slope of the measured step times exceeds {100 * SLOPE_LIMIT:g} % of "
        f"their mean per step, or the mean of the last half differs from the first half's by more than "
        f"{100 * HALVES_LIMIT:g} % of the mean; assessed with >= {MIN_STEPS} measured steps")


def step_trend(times: list[float]) -> dict[str, Any]:
    """The trend of measured step times (seconds, in step order) and whether it is flagged."""
    n = len(times)
    out: dict[str, Any] = {"measured_steps": n, "assessed": n >= MIN_STEPS, "flag": None,
                           "slope_rel_per_step": None, "halves_rel": None}
    if n < 2:
        return out
    mean = statistics.fmean(times)
    x_mean = (n - 1) / 2
    sxx = sum((i - x_mean) ** 2 for i in range(n))
    slope = sum((i - x_mean) * (t - mean) for i, t in enumerate(times)) / sxx
    half = n // 2
    halves = (statistics.fmean(times[n - half:]) - statistics.fmean(times[:half])) / mean
    out.update(slope_rel_per_step=slope / mean, halves_rel=halves)
    if out["assessed"] and (abs(slope / mean) > SLOPE_LIMIT or abs(halves) > HALVES_LIMIT):
        # the sign of whichever measure crossed its limit; the slope's when both did
        sign = slope if abs(slope / mean) > SLOPE_LIMIT else halves
        out["flag"] = "warming_up" if sign < 0 else "slowing_down"
    return out


def trend_label(trend: dict[str, Any] | None) -> str:
    """Text for the report: empty when steady, the flag and the numbers otherwise."""
    if not trend:
        return ""
    if not trend.get("assessed"):
        return f"trend not assessed: {trend.get('measured_steps', 0)} measured steps (< {MIN_STEPS})"
    flag = trend.get("flag")
    if flag is None:
        return ""
    words = "still warming up" if flag == "warming_up" else "slowing down"
    return (f"{words}: steps trend {100 * trend['slope_rel_per_step']:+.1f} %/step, last half "
            f"{100 * trend['halves_rel']:+.1f} % vs first")
