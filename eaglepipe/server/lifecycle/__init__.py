"""The job side of the server: what a server is (identity, launch command), its process group
under the supervisor, the leases and ports, the one shared server per node and run, and the
watchdog its clients run."""
