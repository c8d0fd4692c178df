"""How a figure of a result reads in docs/performance.md's tables: a number,
a median with its spread, a ratio, p50 and p90."""

from __future__ import annotations


NR = "not recorded"


def num(x) -> str:
    if isinstance(x, float):
        return f"{x:g}"
    return NR if x is None else str(x)


def spread(d: dict | None, suffix: str = "") -> str:
    """A summary (median or p50, p90, min, max, n) as "median (p90 x; min-max; n)"."""
    if not isinstance(d, dict):
        return NR
    mid = d.get("median", d.get("p50", d.get("median_ms")))
    lo, hi = d.get("min", d.get("min_ms")), d.get("max", d.get("max_ms"))
    extra = []
    if "p90" in d:
        extra.append(f"p90 {num(d['p90'])}")
    if "p99" in d:
        extra.append(f"p99 {num(d['p99'])}")
    if lo is not None and hi is not None:
        extra.append(f"{num(lo)}–{num(hi)}")
    if "n" in d:
        extra.append(f"n {d['n']}")
    return f"{num(mid)}{suffix}" + (f" ({'; '.join(extra)})" if extra else "")


def middle(d: dict | None) -> float | None:
    if not isinstance(d, dict):
        return None
    return d.get("median", d.get("p50", d.get("median_ms")))


def ratio(ours, anchor) -> str:
    return f"{ours / anchor:.2f}×" if isinstance(ours, (int, float)) and anchor else NR


def sig(x, digits: int = 3) -> str:
    """A figure to `digits` significant digits (at least the units)."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return NR if x is None else str(x)
    if isinstance(x, int) or abs(x) >= 10 ** digits:
        return f"{x:.0f}"
    return f"{x:.{digits}g}"


def signed(x) -> str:
    """A difference, its sign always shown; "-" if there is none."""
    return f"{x:+.3g}" if isinstance(x, (int, float)) and not isinstance(x, bool) else "-"


def p50_p90(d: dict | None, stem: str = "", n: bool = True) -> str:
    """"median (p90 x)" of a dict keyed STEM_p50_ms / STEM_p90_ms, or of a
    summary (median / p50 / median_ms / p50_ms; p90 / p90_ms; n)."""
    if not isinstance(d, dict):
        return NR
    pre = f"{stem}_" if stem else ""
    mid = next((d[k] for k in (f"{pre}p50_ms", f"{pre}median_ms", f"{pre}median", f"{pre}p50") if k in d), None)
    if mid is None:
        return NR
    extra = [f"p90 {sig(d[k])}" for k in (f"{pre}p90_ms", f"{pre}p90") if k in d][:1]
    if not stem and n and "n" in d:
        extra.append(f"n {d['n']}")
    return sig(mid) + (f" ({'; '.join(extra)})" if extra else "")


def p50_p99(d: dict | None) -> str:
    """"median (p90 x; p99 y)" of a summary keyed p50_ms, p90_ms, p99_ms."""
    if not isinstance(d, dict):
        return NR
    extra = [f"{q} {sig(d[f'{q}_ms'])}" for q in ("p90", "p99") if f"{q}_ms" in d]
    return sig(d.get("p50_ms")) + (f" ({'; '.join(extra)})" if extra else "")


def med_span(median, span) -> str:
    """"median (min–max)" of a median kept beside its runs' [min, max]."""
    if isinstance(span, (list, tuple)) and len(span) == 2:
        return f"{sig(median)} ({sig(span[0])}–{sig(span[1])})"
    return sig(median)
