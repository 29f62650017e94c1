"""Per-stage memory choices of candidate plans (:mod:`potluck.planner.memory.refine`)."""
