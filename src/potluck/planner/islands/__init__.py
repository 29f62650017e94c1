"""Islands in the planner: what the exchange between islands costs (:mod:`.exchange`), how
much more training rare synchronization needs (:mod:`.convergence`), and where to split a
cluster and how to synchronize its parts (:mod:`.choose`)."""
