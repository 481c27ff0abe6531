"""The hidden-state server: the reference server and the SGLang recipe, the dump handoff and
request ids both ends share, the lifecycle that starts, shares and stops it, and the watchdog
its clients run."""
