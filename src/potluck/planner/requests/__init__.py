"""What the commands ask of the search, on top of it: searches remembered by cluster shape
(:mod:`potluck.planner.requests.memo`), failures that name host memory when it is the
limit (:mod:`potluck.planner.requests.host_limit`) and what a framework's placement costs
against potluck's (:mod:`potluck.planner.requests.placement_cost`)."""
