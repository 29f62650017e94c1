"""Economics: what training costs, and which GPUs to rent or buy.

``prices`` turns GPUs into dollars per hour (rented on-demand or spot, or
bought: amortized plus electricity); ``figures`` the dollars of one plan (per
hour, per million tokens, to train N tokens, raw TFLOPS per dollar beside
what the plan achieves); ``offers`` reads offers files and builds candidates
from the catalog; ``candidates`` plans and prices each offer; ``rank`` orders
them and finds the Pareto front; ``study`` ties these into ``potluck cost``;
``cheapest`` is ``potluck plan --objective cost``, choosing which of the
user's devices to use; ``report`` and ``plot`` present the results.
"""
