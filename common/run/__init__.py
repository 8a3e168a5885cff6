"""The run itself: its directory, saves and resume, logging and performance figures, the capacity planner,
health, hangs, stop signals, errors and process groups."""
