"""Communication scheduling in the cost model: what Oases's and TriRace's methods overlap and
what they cost, and the search's per-stage choice of them (``docs/execution.md``)."""
