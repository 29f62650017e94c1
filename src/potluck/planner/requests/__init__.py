"""What the commands ask of the search, on top of it: searches remembered by cluster shape
(:mod:`potluck.planner.requests.memo`) and failures that name host memory when it is the
limit (:mod:`potluck.planner.requests.host_limit`)."""
