"""What the commands ask of the search, on top of it: failures that name host memory when
it is the limit (:mod:`potluck.planner.requests.host_limit`)."""
