"""`launch.py plan`: every variant compiled for a topology (`planner`), priced (`bill`, `price`,
`calibrate`) and reported (`report`). Nothing in experiments/launcher/ imports this package."""
