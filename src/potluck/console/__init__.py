"""What the command line shows while it works: progress of long runs
(:mod:`potluck.console.progress`)."""
