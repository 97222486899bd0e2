"""The autoscaler (`ferry planner`): observes SLOs, load and backlogs, decides a worker count, acts on it."""
