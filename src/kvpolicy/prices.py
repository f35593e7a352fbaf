"""The price of a GPU second, in seconds of latency: the prefill queue it shortens.

One formula serves every decision that trades GPU time (the dueling publish judge, the ledger): a second of recompute
saved on a replica whose prefill slots are busy a share ρ of the time is worth ``1/(1 − ρ)`` seconds of latency — the
second itself and the M/M/1 wait ρ/(1 − ρ) it spares the requests behind it — with ρ capped at 0.99 (a price of 100:
past it a queue no longer settles, and every further second is worth the same).

:func:`gpu_price` is the marginal price, for a decision taken in the world as it is. :func:`mean_gpu_price` is its mean
over the utilisations a set's savings moved the replica through, for a total: a set that saves more lowers its own ρ,
so its last saved second is priced lower than its first; priced at the end point alone, the set that saves least and
stays congested would be credited most per second (``tests/test_ledger.py``: a set at the cap after saving one second
outranked one that saved eight and left the cap).
"""

from __future__ import annotations

import math

#: utilisation past which a GPU second's price stops growing (1/(1 − 0.99) = 100)
RHO_CAP = 0.99


def gpu_price(utilisation: float | None) -> float:
    """Seconds of latency one GPU second saves on a replica whose prefill slots are busy ``utilisation`` of the time:
    ``1/(1 − ρ)``, ρ capped at :data:`RHO_CAP`; 1 when unknown."""
    if utilisation is None:
        return 1.0
    return 1.0 / (1.0 - min(utilisation, RHO_CAP))


def _price_integral(rho: float) -> float:
    """∫₀^ρ gpu_price(x) dx: −ln(1 − x) up to the cap, then the cap's price per unit of utilisation."""
    if rho <= RHO_CAP:
        return -math.log1p(-rho)
    return -math.log1p(-RHO_CAP) + (rho - RHO_CAP) / (1.0 - RHO_CAP)


def mean_gpu_price(utilisation: float, utilisation_without_hits: float) -> float:
    """The mean of :func:`gpu_price` over the utilisations between ``utilisation`` (what the replica measured) and
    ``utilisation_without_hits`` (what it would have measured recomputing what it loaded: may pass 1, demand beyond
    its slots): the latency its saved GPU seconds bought, per second saved. Equal utilisations: the marginal price."""
    a, b = utilisation, utilisation_without_hits
    if abs(b - a) < 1e-12:
        return gpu_price(a)
    return (_price_integral(b) - _price_integral(a)) / (b - a)
