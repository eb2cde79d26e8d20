"""A certificate over context groups: when several requests ask about one context, the context is the unit.

The binomial certificate (:mod:`certkv.core.binomial`) treats the n calibration requests as n
independent draws. Questions asked of one document, repository or chat history fail together,
so when requests share contexts the effective sample is the number of contexts, not of
questions, and the binomial bound is too optimistic. Here the contexts are the i.i.d. unit:
context g has n_g questions (its requests), k_g of them violate (loss > τ), and the pairs
(k_g, n_g) are drawn independently from the deployment's distribution over contexts. What the
guarantee bounds is the contract's measure (:class:`~certkv.core.spec.GroupingConfig`):

* ``any_question``: the share of contexts with a violated question. B_g = 1[k_g > 0] is a
  Bernoulli draw, so the exact binomial test on (#violated contexts, #contexts) and its
  Clopper–Pearson bound apply unchanged [1]_;
* ``per_context``: the mean over contexts of k_g / n_g. X_g = k_g / n_g lies in [0, 1], and the
  Hoeffding–Bentkus p-value of a bounded mean [2]_ [3]_ [4]_ tests "E[X] > ε";
* ``per_question``: the share of all questions violated, E[k_g] / E[n_g]. With N the largest
  context size of the table, W_g = (k_g + ε (N − n_g)) / N lies in [0, 1] and E[W] > ε exactly
  when E[k_g − ε n_g] > 0, i.e. when the ratio exceeds ε; the same Hoeffding–Bentkus p-value
  tests it. N is read from the group sizes before any loss is seen; the sizes are drawn with
  the contexts, so this reading treats them as given and speaks of contexts of at most N
  questions (the built-in multi-question tasks cap them at 8).

Hoeffding–Bentkus holds for every distribution on [0, 1], the worst being a context that fails
all or nothing, so it cannot profit from contexts whose questions fail nearly independently (the
per-context statistic then varies little). ``GroupingConfig.bound: betting`` tests the same means
with a betting martingale instead (:func:`betting_p_value`, [5]_ [6]_), whose bets grow with the
evidence and adapt to the statistic's variance.

The p-values feed the spec's family-wise procedure unchanged (:mod:`certkv.core.procedures`);
the reported bound of a Hoeffding–Bentkus measure is the smallest ε' whose p-value is ≤ the
candidate's level, found by bisection, in place of Clopper–Pearson. Torch-free: numpy and scipy.

References
----------
.. [1] C. J. Clopper and E. S. Pearson, "The use of confidence or fiducial limits illustrated in
   the case of the binomial", Biometrika 26(4), 404–413, 1934.
.. [2] W. Hoeffding, "Probability inequalities for sums of bounded random variables", Journal of
   the American Statistical Association 58(301), 13–30, 1963.
.. [3] V. Bentkus, "On Hoeffding's inequalities", The Annals of Probability 32(2), 1650–1673, 2004.
.. [4] S. Bates, A. Angelopoulos, L. Lei, J. Malik and M. I. Jordan, "Distribution-free,
   risk-controlling prediction sets", Journal of the ACM 68(6), 2021; and A. N. Angelopoulos,
   S. Bates, E. J. Candès, M. I. Jordan and L. Lei, "Learn then Test: Calibrating predictive
   algorithms to achieve risk control", arXiv:2110.01052, 2021 (the combined p-value).
.. [5] I. Waudby-Smith and A. Ramdas, "Estimating means of bounded random variables by betting",
   Journal of the Royal Statistical Society Series B 86(1), 1–27, 2024.
.. [6] J. Ville, "Étude critique de la notion de collectif", Gauthier-Villars, 1939 (the maximal
   inequality that makes 1 / max wealth a p-value).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, get_args

import numpy as np
import numpy.typing as npt
from scipy.special import xlogy
from scipy.stats import beta, binom

from certkv.errors import CertkvError

#: What a grouped guarantee bounds (:class:`certkv.core.spec.GroupingConfig`).
Measure = Literal["per_context", "per_question", "any_question"]
MEASURES: tuple[str, ...] = get_args(Measure)
#: How a mean measure is tested (:class:`certkv.core.spec.GroupingConfig`).
Bound = Literal["hoeffding_bentkus", "betting"]
BOUNDS: tuple[str, ...] = get_args(Bound)
#: The largest bet, as a share of the most the wealth can stake without going negative.
BET_CAP = 0.75

_BISECTIONS = 50  # halvings of [0, 1] for a bound: 2**-50, far below any reported digit


def context_order_key(name: str) -> str:
    """The key contexts are ordered by: the sha256 of their name (salted), a pseudo-random order
    fixed before any loss is read. The betting test's wealth depends on the order of its contexts,
    and Ville's inequality needs an order independent of the losses; sorting by the names
    themselves is not (names may follow the data: ``context-<sha>`` for single questions before
    ``multi_question-…`` draws, or a user's document ids that run from easy to hard).

    Examples
    --------
    >>> sorted(["doc-a", "doc-b", "doc-c"], key=context_order_key)
    ['doc-c', 'doc-b', 'doc-a']
    """
    return hashlib.sha256(f"certkv-context-order:{name}".encode()).hexdigest()


@dataclass(frozen=True)
class Groups:
    """The context groups of a table's requests: ``names`` (G,) in :func:`context_order_key`
    order, each request's group index ``codes`` (R,) and each group's question count ``sizes`` (G,).

    Examples
    --------
    >>> groups = Groups.of(["doc-a", "doc-b", "doc-a"])
    >>> groups.names, groups.codes.tolist(), groups.sizes.tolist(), groups.n_groups
    (('doc-b', 'doc-a'), [1, 0, 1], [1, 2], 2)
    >>> groups.counts(np.array([[True, False, True]])).tolist()  # k_g: violated questions per group
    [[0, 2]]
    >>> groups.sums([0.5, 0.25, 1.0]).tolist()
    [0.25, 1.5]
    """

    names: tuple[str, ...]
    codes: np.ndarray
    sizes: np.ndarray

    @classmethod
    def of(cls, labels: Sequence[str]) -> Groups:
        """The groups of requests labelled `labels` (one group name per request)."""
        names = tuple(sorted(set(labels), key=lambda name: (context_order_key(name), name)))
        index = {name: g for g, name in enumerate(names)}
        codes = np.fromiter((index[label] for label in labels), dtype=np.int64, count=len(labels))
        return cls(names, codes, np.bincount(codes, minlength=len(names)).astype(np.int64))

    @property
    def n_groups(self) -> int:
        return len(self.names)

    def counts(self, flags: npt.ArrayLike) -> np.ndarray:
        """Per-group sums of 0/1 `flags` (..., R): the (..., G) integer counts k_g."""
        return np.asarray(flags).astype(np.int64) @ self._one_hot(np.int64)

    def sums(self, values: npt.ArrayLike) -> np.ndarray:
        """Per-group sums of float `values` (..., R), such as the memory each request used: (..., G)."""
        return np.asarray(values, dtype=float) @ self._one_hot(float)

    def _one_hot(self, dtype) -> np.ndarray:
        """(R, G) indicator of each request's group."""
        one_hot = np.zeros((self.codes.size, self.n_groups), dtype=dtype)
        one_hot[np.arange(self.codes.size), self.codes] = 1
        return one_hot


def group_values(
    k: npt.ArrayLike, n: npt.ArrayLike, measure: str, risk: float | npt.ArrayLike = 0.0, n_max: int | None = None
) -> np.ndarray:
    """The per-context statistic in [0, 1] whose mean the measure tests (the module docstring).

    k : (..., G) violated questions per context; n : (G,) questions per context (or any shape
    that broadcasts with `k`, as a resample's); risk : ε (a scalar or (...) array; only
    ``per_question`` reads it); n_max : N (scalar or (...)), default the largest context of each
    row of `n` (``n.max(axis=-1)``).
    Returns (..., G) floats: 1[k_g > 0], k_g / n_g or (k_g + ε (N − n_g)) / N.

    Examples
    --------
    >>> k, n = np.array([0, 1, 4]), np.array([2, 2, 4])
    >>> group_values(k, n, "any_question").tolist(), group_values(k, n, "per_context").tolist()
    ([0.0, 1.0, 1.0], [0.0, 0.5, 1.0])
    >>> group_values(k, n, "per_question", risk=0.5).tolist()  # (k + 0.5 (4 − n)) / 4
    [0.25, 0.5, 1.0]
    """
    k, n = np.asarray(k, dtype=float), np.asarray(n, dtype=float)
    if measure == "any_question":
        return (k > 0).astype(float)
    if measure == "per_context":
        return k / n
    if measure == "per_question":
        big = n.max(axis=-1, keepdims=True) if n_max is None else np.asarray(n_max, dtype=float)[..., None]
        eps = np.asarray(risk, dtype=float)[..., None]
        return (k + eps * (big - n)) / big
    raise CertkvError(f"grouping measure {measure!r} is not one of {', '.join(MEASURES)}")


def grouped_estimate(k: npt.ArrayLike, n: npt.ArrayLike, measure: str) -> np.ndarray:
    """The measure's plug-in estimate on the table: the share of contexts with a violation, the
    mean per-context violation share, or all violated questions over all questions.

    k : (..., G) violated questions per context; n : (G,) questions per context, or broadcast
    with `k`. Returns (...).

    Examples
    --------
    >>> k, n = np.array([0, 1, 4]), np.array([2, 2, 4])
    >>> [round(float(grouped_estimate(k, n, m)), 4) for m in ("any_question", "per_context", "per_question")]
    [0.6667, 0.5, 0.625]
    """
    k, n = np.asarray(k, dtype=float), np.asarray(n, dtype=float)
    if measure == "per_question":
        return k.sum(axis=-1) / n.sum(axis=-1)
    return group_values(k, n, measure).mean(axis=-1)


def hoeffding_bentkus_p_value(mean: npt.ArrayLike, m: int, risk: float | npt.ArrayLike) -> np.ndarray:
    """Hoeffding–Bentkus p-value of "E[X] > ε" from the mean of m i.i.d. draws of X ∈ [0, 1].

    ``min(exp(−m · h(min(x̄, ε), ε)), e · P(Binomial(m, ε) ≤ ⌈m x̄⌉))`` with h(a, b) the
    Bernoulli Kullback–Leibler divergence: Hoeffding's bound [2]_ and Bentkus's [3]_, each a
    valid p-value for every distribution on [0, 1] with mean > ε, so their minimum is one too
    (the combination of [4]_). m·x̄ is rounded to 9 decimals before the ceiling, so float noise
    in a mean of integers cannot move it up a whole count.

    mean : (...) empirical means; m : the number of draws (contexts); risk : ε, broadcast with
    `mean`. Returns (...) p-values in (0, 1].

    Examples
    --------
    No violation on 59 contexts certifies ε = 0.05 at δ = 0.05, as the binomial test does:

    >>> float(hoeffding_bentkus_p_value(0.0, 59, 0.05)) <= 0.05 < float(hoeffding_bentkus_p_value(0.0, 58, 0.05))
    True
    >>> hoeffding_bentkus_p_value([0.01, 0.2], 300, 0.05).round(6).tolist()  # far below ε, above ε
    [0.000446, 1.0]
    """
    if m < 1:
        raise CertkvError(f"a Hoeffding–Bentkus p-value needs at least one draw, got m = {m}")
    mean, risk = np.broadcast_arrays(np.asarray(mean, dtype=float), np.asarray(risk, dtype=float))
    x = np.minimum(mean, risk)
    divergence = np.maximum(xlogy(x, x / risk) + xlogy(1.0 - x, (1.0 - x) / (1.0 - risk)), 0.0)
    hoeffding = np.exp(-m * divergence)
    bentkus = np.e * binom.cdf(np.ceil(np.round(m * mean, 9)), m, risk)
    return np.minimum(hoeffding, bentkus)


def grouped_p_values(
    k: npt.ArrayLike,
    n: npt.ArrayLike,
    measure: str,
    risk: float | npt.ArrayLike,
    n_max: int | None = None,
    bound: str = "hoeffding_bentkus",
) -> np.ndarray:
    """Valid p-values of "the measure > ε" with contexts as the i.i.d. unit, one per row of `k`.

    ``any_question``: the exact binomial P(Binomial(G, ε) ≤ #violated contexts) [1]_; the other
    measures: :func:`hoeffding_bentkus_p_value` of the mean of :func:`group_values` over the G
    contexts, or with ``bound="betting"`` :func:`betting_p_value` of those values, contexts in
    the order given (the table's: :func:`context_order_key`, fixed before any loss).

    k : (..., G) violated questions per context; n : (G,) questions per context, or broadcast
    with `k`; risk : ε (scalar or (...)); n_max : N for ``per_question`` (default ``n.max()``).
    Returns (...).

    Examples
    --------
    Three contexts of four questions out of 100 fail on every question, the rest never:

    >>> k, n = np.r_[np.full(3, 4), np.zeros(97, dtype=int)], np.full(100, 4)
    >>> [round(float(grouped_p_values(k, n, m, 0.1)), 4) for m in ("any_question", "per_context")]
    [0.0078, 0.0213]
    """
    k, n = np.asarray(k), np.asarray(n)
    if measure == "any_question":
        return binom.cdf((k > 0).sum(axis=-1), n.shape[-1], risk)
    eps = np.asarray(risk, dtype=float)
    if _check_bound(bound) == "betting":
        return betting_p_value(group_values(k, n, measure, eps, n_max), eps)
    return hoeffding_bentkus_p_value(_mean_at(k, n, measure, n_max)(eps), n.shape[-1], eps)


def betting_p_value(values: npt.ArrayLike, risk: float | npt.ArrayLike) -> np.ndarray:
    """Betting p-value of "E[X] > ε" from X_1 … X_m ∈ [0, 1] i.i.d., taken in the order given.

    Wealth starts at 1 and bets against "the mean is ≥ ε": after X_i it is multiplied by
    1 + λ_i (ε − X_i), with λ_i chosen from X_1 … X_{i−1} only (predictable): the approximate
    growth-rate-optimal bet (ε − μ̂) / (σ̂² + (ε − μ̂)²) of [5]_ from the running mean μ̂ and
    variance σ̂² (each started at 1/2 and 1/4, a pseudo-observation), clipped to
    [0, BET_CAP / (1 − ε)] so that the wealth stays positive. Under the hypothesis, E[X] ≥ ε,
    the wealth is a nonnegative supermartingale, so by Ville's inequality [6]_
    P(max wealth ≥ 1/α) ≤ α and 1 / max wealth (capped at 1) is a valid p-value; the bet sizes
    follow the statistic's variance, which Hoeffding–Bentkus cannot.

    values : (..., m) in [0, 1]; risk : ε, scalar or (...). Returns (...).

    Examples
    --------
    Two hundred contexts whose per-context share hovers near 6%, at ε = 10%:

    >>> x = np.tile([0.0, 0.125, 0.0, 0.125, 0.0, 0.125, 0.0, 0.125], 25)  # mean 0.0625, low variance
    >>> round(float(betting_p_value(x, 0.1)), 4), round(float(hoeffding_bentkus_p_value(x.mean(), 200, 0.1)), 4)
    (0.0045, 0.1538)
    >>> float(betting_p_value(np.full(50, 0.2), 0.1))  # above ε: no evidence
    1.0
    """
    x = np.asarray(values, dtype=float)
    eps = np.asarray(risk, dtype=float)[..., None]
    count = np.arange(2, x.shape[-1] + 2)  # the pseudo-observation counts too
    mean = (0.5 + np.cumsum(x, axis=-1)) / count
    var = (0.25 + np.cumsum((x - mean) ** 2, axis=-1)) / count
    start = np.ones(x.shape[:-1] + (1,))
    mean_before = np.concatenate([0.5 * start, mean[..., :-1]], axis=-1)
    var_before = np.concatenate([0.25 * start, var[..., :-1]], axis=-1)
    gap = eps - mean_before
    bet = np.clip(gap / (var_before + gap**2), 0.0, BET_CAP / (1.0 - eps))
    log_wealth = np.cumsum(np.log1p(bet * (eps - x)), axis=-1)
    return np.exp(-np.maximum(log_wealth.max(axis=-1), 0.0))


def _check_bound(bound: str) -> str:
    if bound not in BOUNDS:
        raise CertkvError(f"grouping bound {bound!r} is not one of {', '.join(BOUNDS)}")
    return bound


def _mean_at(k: np.ndarray, n: np.ndarray, measure: str, n_max) -> Callable[[np.ndarray], np.ndarray]:
    """The mean of :func:`group_values` over the contexts as a function of ε, reduced over the
    contexts once: W̄(ε) = (k̄ + ε (N − n̄)) / N is linear in ε, so a bisection never revisits them."""
    if measure == "per_context":
        mean = group_values(k, n, measure).mean(axis=-1)
        return lambda risk: mean
    if measure != "per_question":
        raise CertkvError(f"grouping measure {measure!r} has no Hoeffding–Bentkus mean; use one of {', '.join(MEASURES)}")
    n = np.asarray(n, dtype=float)
    big = n.max(axis=-1) if n_max is None else np.asarray(n_max, dtype=float)
    k_bar, n_bar = np.asarray(k, dtype=float).mean(axis=-1), n.mean(axis=-1)
    return lambda risk: (k_bar + risk * (big - n_bar)) / big


def grouped_upper_bound(
    k: npt.ArrayLike,
    n: npt.ArrayLike,
    measure: str,
    confidence: float | npt.ArrayLike,
    n_max: int | None = None,
    bound: str = "hoeffding_bentkus",
) -> np.ndarray:
    """Upper confidence bound on the measure at `confidence`, dual to :func:`grouped_p_values`.

    ``any_question``: the Clopper–Pearson bound on (#violated contexts, G) [1]_. Otherwise the
    smallest ε' whose p-value is ≤ 1 − confidence, by bisection on [0, 1] (1 when none is): the
    Hoeffding–Bentkus p-value falls as ε' grows (for ``per_question`` W moves with ε' too; its
    Hoeffding part still falls, its Bentkus part steps; the betting p-value falls too, up to
    how its bets move with ε'), so the bound is ≤ ε where the p-value at ε is ≤ the level, up to
    2⁻⁵⁰. The decision is the p-value's; the bound reports it.

    k : (..., G); n : (G,) or broadcast with `k`; confidence : scalar or (...) (1 − each
    candidate's level). Returns (...).

    Examples
    --------
    >>> k, n = np.r_[np.full(3, 4), np.zeros(97, dtype=int)], np.full(100, 4)
    >>> round(float(grouped_upper_bound(k, n, "any_question", 0.95)), 4)
    0.0757
    >>> bound = grouped_upper_bound(k, n, "per_context", 0.95)
    >>> round(float(bound), 4), bool(grouped_p_values(k, n, "per_context", float(bound)) <= 0.05)
    (0.0892, True)
    """
    k, n = np.asarray(k), np.asarray(n)
    confidence = np.asarray(confidence, dtype=float)
    if measure == "any_question":
        hits = np.broadcast_to((k > 0).sum(axis=-1), np.broadcast_shapes(k.shape[:-1], confidence.shape))
        conf = np.broadcast_to(confidence, hits.shape)
        m = n.shape[-1]
        upper = np.where(hits >= m, 1.0, beta.ppf(conf, hits + 1, np.maximum(m - hits, 1)))
        return np.asarray(upper, dtype=float)
    level = 1.0 - confidence
    shape = np.broadcast_shapes(k.shape[:-1], level.shape)
    if _check_bound(bound) == "betting":
        return _bisect(lambda eps: betting_p_value(group_values(k, n, measure, eps, n_max), eps), level, shape)
    mean_at, m = _mean_at(k, n, measure, n_max), n.shape[-1]
    return _bisect(lambda eps: hoeffding_bentkus_p_value(mean_at(eps), m, eps), level, shape)


def _bisect(p_of: Callable[[np.ndarray], np.ndarray], level: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """The smallest ε' in (0, 1] with ``p_of(ε') ≤ level`` (elementwise; 1 when none), by bisection."""
    low, high = np.zeros(shape), np.ones(shape)
    for _ in range(_BISECTIONS):
        mid = (low + high) / 2.0
        rejects = p_of(mid) <= level
        high = np.where(rejects, mid, high)
        low = np.where(rejects, low, mid)
    return high


def grouped_promise(measure: str, risk: float, tolerance: float) -> str:
    """What a grouped guarantee promises, in words: the clause after "with probability ≥ 1 − δ
    over the calibration draw," (the guarantee sentences use it).

    Examples
    --------
    >>> grouped_promise("per_context", 0.05, 0.0)
    'at most 5% of questions lose more than 0.0 utility, each context weighted equally, contexts drawn as in calibration'
    >>> grouped_promise("any_question", 0.05, 0.0)
    'at most 5% of contexts have a question that loses more than 0.0 utility, contexts drawn as in calibration'
    """
    share, loss = f"at most {risk * 100:g}%", f"more than {float(tolerance)} utility"
    promises = {
        "per_context": f"{share} of questions lose {loss}, each context weighted equally",
        "per_question": f"{share} of questions lose {loss}, each question counted once",
        "any_question": f"{share} of contexts have a question that loses {loss}",
    }
    if measure not in promises:
        raise CertkvError(f"grouping measure {measure!r} is not one of {', '.join(MEASURES)}")
    return promises[measure] + ", contexts drawn as in calibration"


def check_group_strata(groups: Sequence[str], labels: Sequence[str], by: str) -> None:
    """A context group must lie in one stratum (a stratum certifies its own contexts): a one-line
    error names the first group whose requests span two `by` strata (`labels`, one per request).

    Examples
    --------
    >>> check_group_strata(["d0", "d0", "d1"], ["qa", "qa", "code"], "task")
    >>> check_group_strata(["d0", "d0"], ["qa", "code"], "task")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    certkv.errors.CertkvError: group 'd0' spans task strata 'code' and 'qa'; a context's questions must share ...
    """
    seen: dict[str, str] = {}
    for group, label in zip(groups, labels):
        first = seen.setdefault(group, label)
        if first != label:
            a, b = sorted((first, label))
            raise CertkvError(
                f"group {group!r} spans {by} strata {a!r} and {b!r}; a context's questions must share one stratum "
                "(label the stratum per context)"
            )


__all__ = [
    "BET_CAP",
    "BOUNDS",
    "MEASURES",
    "Bound",
    "Groups",
    "context_order_key",
    "Measure",
    "betting_p_value",
    "check_group_strata",
    "group_values",
    "grouped_estimate",
    "grouped_p_values",
    "grouped_promise",
    "grouped_upper_bound",
    "hoeffding_bentkus_p_value",
]
